// The flowjam instrument: a thin output of the engine's loop buffer on a DAW track. The host's transport is the
// clock: the loop position comes from its bar position, its play and stop start and fade the loop; every knob of
// the registry is a host parameter that the engine applies on its next tick (volume at once, here). Not connected
// (no engine, or a stale heartbeat): silence, and the "connected" output parameter reads 0. With `on_stop` at
// free-run the host's stop leaves the loop running on its own clock; `panel` has the engine open its web panel; an
// offline render (told by the host's pace, host_pace.hpp) waits, bounded, for the engine's first loop.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "DistrhoPlugin.hpp"
#include "block_times.hpp"
#include "engine_link.hpp"
#include "flowjam_generated.h"
#include "host_pace.hpp"
#include "platform.hpp"
#include "render_core.hpp"

START_NAMESPACE_DISTRHO

using namespace flowjam;

namespace {
constexpr uint32_t kBars = KNOB_COUNT;       // the loop's length in bars (0: the engine's --bars)
constexpr uint32_t kClick = KNOB_COUNT + 1;  // the click: as the engine was started, off, on
constexpr uint32_t kConnected = KNOB_COUNT + 2;  // output parameter: 1 while the engine is attached and alive
constexpr uint32_t kPanel = KNOB_COUNT + 3;      // turned on: the engine opens its panel in the browser
constexpr uint32_t kOnStop = KNOB_COUNT + 4;     // the host's stop: fade the loop out, or let it run on
constexpr uint32_t kParameterCount = KNOB_COUNT + 5;
enum { kClickEngine, kClickOff, kClickOn };
enum { kOnStopFade, kOnStopFreeRun };
constexpr int64_t kWaitPerBlockNs = 2000000000LL;  // an offline block waits at most 2 s for the engine's loop
constexpr int64_t kWaitPerEngineNs = 30000000000LL;  // and all blocks at most 30 s for one engine's first loop
enum { kStateSession, kStateEngineCommand, kStatePrompt, kStatePromptB, kStateNegative, kStateCount };
constexpr const char* kPromptKeys[3] = {"prompt", "prompt_b", "negative"};

// A new instance's session: $FLOWJAM_SESSION where the host was started with it (a headless host, a test), else
// "" (the engine's lobby names a new session: the engine's --session first, then track-2, ...); the project's state
// names it from then on.
std::string default_session() {
    const char* session = std::getenv("FLOWJAM_SESSION");
    return session != nullptr ? session : "";
}

int prompt_slot(const char* key) {
    for (int slot = 0; slot < 3; ++slot)
        if (std::strcmp(key, kPromptKeys[slot]) == 0) return slot;
    return -1;
}
constexpr int kVolume = KNOB_COUNT - 1;
static_assert(kVolume >= 0, "the registry has a volume knob");
constexpr double kTempoToleranceBpm = 0.05;  // live/tempo_switch.py: a host this close to the loop's tempo locks

int knob_index(const char* name) {
    for (int i = 0; i < KNOB_COUNT; ++i)
        if (std::strcmp(KNOBS[i].name, name) == 0) return i;
    return -1;
}
}  // namespace

class FlowjamPlugin : public Plugin {
public:
    FlowjamPlugin() : Plugin(kParameterCount, 0, kStateCount), volumeIndex(knob_index("volume")) {
        link.setSession(default_session());
        for (int i = 0; i < KNOB_COUNT; ++i) {
            values[i] = static_cast<float>(KNOBS[i].defaultValue);
            dirty[i].store(true);
        }
        prepare();
    }

protected:
    const char* getLabel() const override { return "flowjam"; }
    const char* getDescription() const override {
        return "A live ACE-Step stream on a DAW track, on the host's grid (needs `python -m flowjam live --plugin`).";
    }
    const char* getMaker() const override { return "flowjam"; }
    const char* getLicense() const override { return "Apache-2.0"; }
    uint32_t getVersion() const override { return d_version(0, 1, 0); }
    int64_t getUniqueId() const override { return d_cconst('F', 'j', 'a', 'm'); }

    void initAudioPort(bool input, uint32_t index, AudioPort& port) override {
        port.groupId = kPortGroupStereo;
        Plugin::initAudioPort(input, index, port);
    }

    void initParameter(uint32_t index, Parameter& parameter) override {
        if (index == kBars) {
            parameter.hints = kParameterIsAutomatable | kParameterIsInteger;
            parameter.name = "bars";
            parameter.symbol = "bars";
            parameter.unit = "bars";
            parameter.description = "the loop's length in bars, made again on a change (0: the engine's --bars)";
            parameter.ranges = ParameterRanges(0.0f, 0.0f, static_cast<float>(control::MAX_LOOP_BARS));
            return;
        }
        if (index == kClick) {
            parameter.hints = kParameterIsAutomatable | kParameterIsInteger;
            parameter.name = "click";
            parameter.symbol = "click";
            parameter.description = "a metronome click on every bar start: as the engine was started, off or on";
            parameter.ranges = ParameterRanges(0.0f, 0.0f, 2.0f);
            auto* choices = new ParameterEnumerationValue[3];
            choices[0].value = kClickEngine;
            choices[0].label = "engine";
            choices[1].value = kClickOff;
            choices[1].label = "off";
            choices[2].value = kClickOn;
            choices[2].label = "on";
            parameter.enumValues.count = 3;
            parameter.enumValues.restrictedMode = true;
            parameter.enumValues.values = choices;
            return;
        }
        if (index == kPanel) {
            parameter.hints = kParameterIsAutomatable | kParameterIsBoolean | kParameterIsInteger;
            parameter.name = "panel";
            parameter.symbol = "panel";
            parameter.description = "turned on: the engine opens its prompt and knob panel in the browser";
            parameter.ranges = ParameterRanges(0.0f, 0.0f, 1.0f);
            return;
        }
        if (index == kOnStop) {
            parameter.hints = kParameterIsAutomatable | kParameterIsInteger;
            parameter.name = "on_stop";
            parameter.symbol = "on_stop";
            parameter.description = "the host's stop: fade the loop out, or free-run it on its own clock until play";
            parameter.ranges = ParameterRanges(0.0f, 0.0f, 1.0f);
            auto* choices = new ParameterEnumerationValue[2];
            choices[0].value = kOnStopFade;
            choices[0].label = "fade";
            choices[1].value = kOnStopFreeRun;
            choices[1].label = "free-run";
            parameter.enumValues.count = 2;
            parameter.enumValues.restrictedMode = true;
            parameter.enumValues.values = choices;
            return;
        }
        if (index == kConnected) {
            parameter.hints = kParameterIsOutput | kParameterIsBoolean | kParameterIsInteger;
            parameter.name = "connected";
            parameter.symbol = "connected";
            parameter.description = "1 while the engine runs and this instance plays its session";
            parameter.ranges = ParameterRanges(0.0f, 0.0f, 1.0f);
            return;
        }
        const KnobInfo& knob = KNOBS[index];
        parameter.hints = kParameterIsAutomatable | (knob.integer ? kParameterIsInteger : 0);
        parameter.name = knob.name;
        parameter.symbol = knob.name;
        parameter.unit = knob.unit;
        parameter.description = knob.description;
        parameter.ranges = ParameterRanges(static_cast<float>(knob.defaultValue), static_cast<float>(knob.minimum),
                                           static_cast<float>(knob.maximum));
        if (knob.choiceCount > 0) {
            auto* choices = new ParameterEnumerationValue[knob.choiceCount];
            for (int i = 0; i < knob.choiceCount; ++i) {
                choices[i].value = static_cast<float>(i);
                choices[i].label = knob.choices[i];
            }
            parameter.enumValues.count = static_cast<uint8_t>(knob.choiceCount);
            parameter.enumValues.restrictedMode = true;
            parameter.enumValues.values = choices;
        }
    }

    void initState(uint32_t index, State& state) override {
        state.hints = kStateIsOnlyForDSP;
        if (index == kStateSession) {
            state.key = "session";
            state.defaultValue = default_session().c_str();
            state.label = "Session";
            state.description = "the engine session this instance plays (empty: a new one, named by the engine)";
        } else if (index == kStateEngineCommand) {
            state.key = "engine_command";
            state.defaultValue = "";
            state.label = "Engine command";
            state.description = "a shell command that starts the engine when none answers (empty: none)";
        } else {
            state.key = kPromptKeys[index - kStatePrompt];
            state.defaultValue = "";
            state.label = state.key;
            state.description = "the session's prompt as the engine plays it, saved with the project and given back";
        }
    }

    String getState(const char* key) const override {
        if (std::strcmp(key, "session") == 0) return String(link.session().c_str());
        if (std::strcmp(key, "engine_command") == 0) return String(link.engineCommand().c_str());
        const int slot = prompt_slot(key);
        return slot >= 0 ? String(link.prompt(slot).c_str()) : String();
    }

    float getParameterValue(uint32_t index) const override {
        if (index == kConnected) return connected.load() ? 1.0f : 0.0f;
        if (index == kBars) return loopBars;
        if (index == kClick) return click;
        if (index == kPanel) return panel;
        if (index == kOnStop) return onStop;
        return values[index];
    }

    void setParameterValue(uint32_t index, float value) override {
        if (index == kPanel) {
            if (value >= 0.5f && panel < 0.5f) panelPresses.fetch_add(1);
            panel = value;
            return;
        }
        if (index == kOnStop) {
            onStop = value;
            return;
        }
        if (index == kBars || index == kClick) {
            float& held = index == kBars ? loopBars : click;
            if (held != value) loopDirty.store(true);
            held = value;
            return;
        }
        if (index >= static_cast<uint32_t>(KNOB_COUNT) || values[index] == value) return;  // a host resending
        values[index] = value;
        dirty[index].store(true);
    }

    void setState(const char* key, const char* value) override {
        if (std::strcmp(key, "session") == 0) link.setSession(value[0] != '\0' ? value : default_session());
        if (std::strcmp(key, "engine_command") == 0) link.setEngineCommand(value);
        const int slot = prompt_slot(key);
        if (slot >= 0) link.setPrompt(slot, value);
    }

    void bufferSizeChanged(uint32_t) override { prepare(); }
    void sampleRateChanged(double) override { prepare(); }
    void activate() override {
        prepare();
        link.setActive();
    }

    void run(const float**, float** outputs, uint32_t frames) override {
        const int64_t started = monotonic_ns();
        const bool offline = pace.block(started, static_cast<int>(frames));
        Attachment* attached = link.acquire();
        const bool usable = attached != nullptr && attached->view.channels == 2 &&
                            attached->view.counters[counter::SAMPLE_RATE] == static_cast<int64_t>(getSampleRate()) &&
                            frames <= static_cast<uint32_t>(state.blocksize);
        connected.store(usable);
        if (!usable) {
            panelPresses.store(0);  // a press with no engine to open the panel is none
            std::memset(outputs[0], 0, sizeof(float) * frames);
            std::memset(outputs[1], 0, sizeof(float) * frames);
            link.release();
            return;
        }
        if (attached->generation != renderGeneration) {  // a new engine, or the renderer prepared again
            renderGeneration = attached->generation;
            render_attach(state, attached->view);
            wasPlaying = -1;
        }
        if (attached->generation != loopGeneration) {  // attached again: its loop buffer may be new, set its click
            loopGeneration = attached->generation;
            loopDirty.store(true);
            if (attached->engineId != knobEngine) {  // a new engine: the project's values win
                knobEngine = attached->engineId;     // (the same one back after a stall keeps the player's changes)
                for (int i = 0; i < KNOB_COUNT; ++i) {
                    dirty[i].store(true);
                    engineChangesSeen[i] = attached->engineChanges[i];  // what it changed before is not shown
                }
                waitLeftNs = kWaitPerEngineNs;
            }
        }
        const LoopView& view = attached->view;
        publishTransport(*attached, frames);
        publishKnobs(*attached, started);
        showEngineKnobs(*attached);
        publishLoop(*attached);
        attached->controlCounters[control::HOST_PANEL_REQUESTS] += panelPresses.exchange(0);
        attached->controlReals[control::HOST_OFFLINE] = offline ? 1.0 : 0.0;
        if (offline) waitForLoop(*attached);
        float* block = interleaved.data();
        render_block(state, view, block, static_cast<int>(frames), sync_clock_s());
        for (uint32_t i = 0; i < frames; ++i) {
            outputs[0][i] = block[2 * i];
            outputs[1][i] = block[2 * i + 1];
        }
        record_block_time(attached->blockTimes, monotonic_ns() - started);
        attached->controlCounters[control::HOST_BLOCKS] += 1;
        link.release();
    }

private:
    void prepare() {
        const int blocksize = std::max<int>(1, static_cast<int>(getBufferSize()));
        render_prepare(state, blocksize, 2, static_cast<int>(getSampleRate()));
        interleaved.assign(static_cast<size_t>(blocksize) * 2, 0.0f);
        renderGeneration = 0;
        pace.prepare(blocksize, getSampleRate());
    }

    // Offline only (in real time the plugin never waits): hold the block until the engine has written the loop it
    // plays (its first generation; before it the buffer is silence), sleeping in 2 ms steps, at most kWaitPerBlockNs
    // for a block and kWaitPerEngineNs in all for one engine; a watcher letting go of the engine ends the wait.
    void waitForLoop(Attachment& a) {
        double* reals = a.controlReals;
        if (loopWritten(reals) || waitLeftNs <= 0) return;
        const int64_t start = monotonic_ns();
        int64_t waited = 0;
        while (!loopWritten(reals) && waited < kWaitPerBlockNs && waited < waitLeftNs && link.holds(&a)) {
            sleep_ms(2);
            waited = monotonic_ns() - start;
        }
        waitLeftNs -= waited;
        pace.held(waited);
        reals[control::HOST_WAITS] += 1.0;
        reals[control::HOST_WAITED_S] += waited / 1e9;
    }

    static bool loopWritten(double* reals) {
        double written;
        __atomic_load(&reals[control::ENGINE_LOOP_WRITTEN], &written, __ATOMIC_ACQUIRE);
        return written != 0.0;
    }

    // The host's transport into the control block, and the loop position from its bars: where the host's tempo and
    // metre are the loop's, the position is its bar position on the loop (bar 1 of the loop on the host's bar 1,
    // and on every bar that starts a cycle of the loop's bars); elsewhere the loop runs on from where it is.
    void publishTransport(Attachment& a, uint32_t frames) {
        const TimePosition& time = getTimePosition();
        const double rate = getSampleRate();
        int64_t* control = a.controlCounters;
        double* reals = a.controlReals;
        const bool playing = time.playing;
        double bars = -1.0;
        if (time.bbt.valid && time.bbt.beatsPerBar > 0 && time.bbt.ticksPerBeat > 0) {
            bars = (time.bbt.bar - 1) + ((time.bbt.beat - 1) + time.bbt.tick / time.bbt.ticksPerBeat) /
                                            time.bbt.beatsPerBar;
            reals[control::HOST_BPM] = time.bbt.beatsPerMinute;
            reals[control::HOST_BEATS_PER_BAR] = time.bbt.beatsPerBar;
            reals[control::HOST_BARS] = bars;
        }
        control[control::HOST_PLAYING] = playing ? 1 : 0;
        control[control::HOST_FRAME] = static_cast<int64_t>(time.frame);
        control[control::HOST_SAMPLE_RATE] = static_cast<int64_t>(rate);
        control[control::HOST_BLOCK_FRAMES] = state.blocksize;

        int64_t* c = a.view.counters;
        if (playing && bars >= 0.0) {
            const int64_t pending = c[counter::SWITCH_TO];
            int64_t played;
            if (c[counter::SWITCH_AT] == BAR_SWITCH && hostPosition(a, pending, bars, time, played) &&
                (std::ceil(bars - 1e-9) - bars) * a.view.reals[real::BAR_FRAMES[pending]] < frames) {
                // The host's bar line falls in this block: the new loop from it, the block crossfaded from the old
                // loop where it was (BlockRenderer.switch takes a switch for the whole block it falls in).
                state.appliedShift += c[counter::PLAYED] - played;
                c[counter::PLAYED] = played;
                c[counter::SWITCH_AT] = played;
            } else if (hostPosition(a, c[counter::ACTIVE], bars, time, played)) {
                // Back from free-running (the loop on its own clock while the host stood): the host's position,
                // the block crossfaded from where the loop was.
                if (freeRunning) state.appliedShift += c[counter::PLAYED] - played;
                c[counter::PLAYED] = played;
            }
        }
        const int state = playing ? 1 : 0;
        if (state != wasPlaying) {  // the host's start is a hard edge, as for any track; its stop fades out (10 ms)
            freeRunning = !playing && wasPlaying == 1 && std::lround(onStop) == kOnStopFreeRun;
            a.view.reals[real::TRANSPORT] = playing || freeRunning ? 1.0 : 0.0;
            if (playing) a.view.reals[real::APPLIED_TRANSPORT] = 1.0;
            wasPlaying = state;
        } else if (freeRunning && std::lround(onStop) != kOnStopFreeRun) {  // free-run turned off while stopped
            freeRunning = false;
            a.view.reals[real::TRANSPORT] = 0.0;
        }
    }

    // The frame played at which `region` sits on the host's bar position `bars` (bar 1 of the loop on the host's bar
    // 1 and on every bar that starts a cycle of the loop's bars), where the host plays at the region's tempo.
    bool hostPosition(const Attachment& a, int64_t region, double bars, const TimePosition& time, int64_t& played) {
        if (region < 0 || region >= MAX_REGIONS) return false;
        const int64_t* c = a.view.counters;
        const int64_t loopBars = c[counter::BARS[region]];
        const double barFrames = a.view.reals[real::BAR_FRAMES[region]];
        if (loopBars <= 0 || barFrames <= 0.0) return false;
        const double loopBpm = time.bbt.beatsPerBar * 60.0 * getSampleRate() / barFrames;
        if (std::fabs(loopBpm - time.bbt.beatsPerMinute) > kTempoToleranceBpm) return false;
        const double cycles = std::floor(bars / static_cast<double>(loopBars));
        const double within = bars - cycles * static_cast<double>(loopBars);
        played = static_cast<int64_t>(cycles) * c[counter::LENGTHS[region]] + std::llround(within * barFrames) -
                 c[counter::SHIFTS[region]];
        return true;
    }

    // The bars asked of the engine (it makes the loop again, switched on a bar line), and the click, set here at once.
    void publishLoop(Attachment& a) {
        if (!loopDirty.exchange(false)) return;
        a.controlCounters[control::HOST_LOOP_BARS] = static_cast<int64_t>(std::lround(loopBars));
        const int mode = static_cast<int>(std::lround(click));
        const bool on = mode == kClickOn || (mode == kClickEngine && a.controlCounters[control::ENGINE_CLICK] != 0);
        const double bar = a.view.reals[real::BAR_FRAMES[a.view.counters[counter::ACTIVE]]];
        a.view.reals[real::CLICK_BAR] = on && bar >= MIN_CLICK_BAR ? bar : 0.0;
        a.view.reals[real::CLICK_CYCLE] = 0.0;
    }

    // The knobs the host changed since the last block: to the engine (its next tick), volume to the gain at once;
    // `blockNs`, the block's start, tells the engine how long they took to reach it.
    void publishKnobs(Attachment& a, int64_t blockNs) {
        bool published = false;
        for (int i = 0; i < KNOB_COUNT; ++i) {
            if (!dirty[i].exchange(false)) continue;
            a.hostValues[i] = values[i];
            if (!published) a.controlCounters[control::HOST_CHANGES_NS] = blockNs;
            published = true;
            a.hostChanges[i] += 1;
            if (i == volumeIndex) a.view.reals[real::GAIN] = values[i];
        }
    }

    // The knobs the engine changed by itself (OSC, MIDI, the panel): the plugin's values, and a change request to the
    // host where its format lets a plugin ask (VST3, VST2, LV2 hosts with the change-request feature; DPF's CLAP
    // drops it). A change the host made that is still on its way to the engine wins: it is the newer.
    void showEngineKnobs(Attachment& a) {
        for (int i = 0; i < KNOB_COUNT; ++i) {
            const int64_t changes = a.engineChanges[i];
            if (changes == engineChangesSeen[i]) continue;
            engineChangesSeen[i] = changes;
            const float value = static_cast<float>(a.engineValues[i]);
            if (dirty[i].load() || values[i] == value) continue;
            values[i] = value;
            requestParameterValueChange(static_cast<uint32_t>(i), value);
        }
    }

    EngineLink link;
    RenderState state;
    std::vector<float> interleaved;
    float values[KNOB_COUNT];
    int64_t engineChangesSeen[KNOB_COUNT] = {};  // the engine's change counts shown so far
    std::atomic<bool> dirty[KNOB_COUNT];
    std::atomic<bool> connected{false};
    float loopBars = 0.0f, click = kClickEngine;
    float panel = 0.0f, onStop = kOnStopFade;
    std::atomic<int64_t> panelPresses{0};
    bool freeRunning = false;  // the host stopped with on_stop at free-run: the loop plays on from where it was
    HostPace pace;
    int64_t waitLeftNs = kWaitPerEngineNs;
    std::atomic<bool> loopDirty{true};
    uint64_t renderGeneration = 0, loopGeneration = 0;  // the attachment the renderer and the loop were set for
    int64_t knobEngine = 0;                               // the engine (ENGINE_ID) the project's knobs were given to
    int wasPlaying = -1;
    const int volumeIndex;

    DISTRHO_DECLARE_NON_COPYABLE_WITH_LEAK_DETECTOR(FlowjamPlugin)
};

Plugin* createPlugin() { return new FlowjamPlugin(); }

END_NAMESPACE_DISTRHO
