// A minimal CLAP host for the tests (no CLAP host installs here): loads a .clap (N instances of it, as N tracks),
// finds the plugin's parameters by name, plays `bars` bars of 4/4 at `bpm` through each instance's process() with the
// host transport every block (paced to real time with --realtime), and writes each instance's stereo output as
// interleaved float32 to a file. Before playing it runs stopped blocks until every instance's `connected` parameter
// reads 1 (at most 60 s), then --wait S seconds more. --set I:NAME=VALUE sets instance I's parameter NAME (its plain
// value) in its first block; NAME=VALUE sets it on every instance. stop=AT:FOR stops the transport at the first block
// from song bar AT (bar 1 = 0) for FOR bars of blocks, its song position standing, then plays on from there (the
// output holds every block, stopped ones too).
//   clap_render PLUGIN.clap OUT.f32 BPM BARS [--instances N] [--wait S] [--realtime] [--set I:NAME=VALUE]...
//               [NAME=VALUE ...] [stop=AT:FOR]
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmath>
#include <string>
#include <vector>

#include "clap/entry.h"
#include "clap/ext/params.h"
#include "clap/plugin-factory.h"

namespace {

constexpr double RATE = 48000.0;
constexpr uint32_t BLOCK = 512;

const void* host_extension(const clap_host_t*, const char*) { return nullptr; }
void host_nothing(const clap_host_t*) {}

const clap_host_t HOST = {CLAP_VERSION, nullptr, "flowjam-test-host", "flowjam", "", "0", host_extension,
                          host_nothing, host_nothing, host_nothing};

bool drop_event(const clap_output_events_t*, const clap_event_header_t*) { return true; }

int fail(const char* what) {
    fprintf(stderr, "clap_render: %s\n", what);
    return 1;
}

// One instance of the plugin, its parameters found by name, the events of its next block and what it played.
struct Instance {
    const clap_plugin_t* plugin = nullptr;
    const clap_plugin_params_t* params = nullptr;
    clap_id connected = CLAP_INVALID_ID;
    std::vector<clap_event_param_value_t> events;
    std::vector<float> output;

    clap_id find(const char* name) const {
        for (uint32_t i = 0; i < params->count(plugin); ++i) {
            clap_param_info_t info;
            if (params->get_info(plugin, i, &info) && strcmp(info.name, name) == 0) return info.id;
        }
        return CLAP_INVALID_ID;
    }

    bool isConnected() const {
        double value = 0.0;
        return params->get_value(plugin, connected, &value) && value == 1.0;
    }
};

uint32_t event_count(const clap_input_events_t* list) {
    return static_cast<uint32_t>(static_cast<const Instance*>(list->ctx)->events.size());
}
const clap_event_header_t* event_at(const clap_input_events_t* list, uint32_t index) {
    return &static_cast<const Instance*>(list->ctx)->events[index].header;
}

void pace(const timespec& started, int64_t frame, bool realtime) {
    if (!realtime) return;
    const double due = started.tv_sec + started.tv_nsec * 1e-9 + frame / RATE;
    timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    const double wait = due - (now.tv_sec + now.tv_nsec * 1e-9);
    if (wait > 0) {
        timespec pause = {static_cast<time_t>(wait), static_cast<long>((wait - std::floor(wait)) * 1e9)};
        nanosleep(&pause, nullptr);
    }
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 5)
        return fail("usage: clap_render PLUGIN.clap OUT.f32 BPM BARS [--instances N] [--wait S] [--realtime] [--set ...] "
                    "[NAME=VALUE ...] [stop=AT:FOR]");
    const double bpm = atof(argv[3]);
    const int bars = atoi(argv[4]);
    int count = 1;
    bool realtime = false;
    double wait_s = 0.0, stopAtBar = -1.0, stopBars = 0.0;
    std::vector<std::string> settings, everywhere;
    for (int i = 5; i < argc; ++i) {
        if (strcmp(argv[i], "--instances") == 0 && i + 1 < argc) {
            count = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--wait") == 0 && i + 1 < argc) {
            wait_s = atof(argv[++i]);
        } else if (strcmp(argv[i], "--realtime") == 0) {
            realtime = true;
        } else if (strcmp(argv[i], "--set") == 0 && i + 1 < argc) {
            settings.push_back(argv[++i]);
        } else if (strncmp(argv[i], "stop=", 5) == 0) {
            if (sscanf(argv[i] + 5, "%lf:%lf", &stopAtBar, &stopBars) != 2) return fail("stop=AT:FOR takes two bars");
        } else if (argv[i][0] != '-' && strchr(argv[i], '=') != nullptr) {
            everywhere.push_back(argv[i]);
        } else {
            return fail("unknown option (--instances N, --wait S, --realtime, --set I:NAME=VALUE, NAME=VALUE, stop=AT:FOR)");
        }
    }
    for (int i = 0; i < count; ++i)
        for (const std::string& setting : everywhere) settings.push_back(std::to_string(i) + ":" + setting);
    void* library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) return fail(dlerror());
    auto* entry = static_cast<const clap_plugin_entry_t*>(dlsym(library, "clap_entry"));
    if (entry == nullptr || !entry->init(argv[1])) return fail("no clap_entry, or it did not init");
    auto* factory = static_cast<const clap_plugin_factory_t*>(entry->get_factory(CLAP_PLUGIN_FACTORY_ID));
    if (factory == nullptr || factory->get_plugin_count(factory) < 1) return fail("no plugin in the factory");
    const clap_plugin_descriptor_t* descriptor = factory->get_plugin_descriptor(factory, 0);
    std::vector<Instance> instances(count);
    for (Instance& instance : instances) {
        instance.plugin = factory->create_plugin(factory, &HOST, descriptor->id);
        if (instance.plugin == nullptr || !instance.plugin->init(instance.plugin)) return fail("the plugin did not init");
        instance.params =
            static_cast<const clap_plugin_params_t*>(instance.plugin->get_extension(instance.plugin, CLAP_EXT_PARAMS));
        if (instance.params == nullptr) return fail("the plugin has no parameters extension");
        instance.connected = instance.find("connected");
        if (instance.connected == CLAP_INVALID_ID) return fail("no parameter named connected");
        if (!instance.plugin->activate(instance.plugin, RATE, BLOCK, BLOCK) ||
            !instance.plugin->start_processing(instance.plugin))
            return fail("the plugin did not activate");
    }
    for (const std::string& setting : settings) {  // I:NAME=VALUE, sent in the instance's first block
        const size_t colon = setting.find(':'), equals = setting.find('=');
        if (colon == std::string::npos || equals == std::string::npos || equals < colon) return fail("--set I:NAME=VALUE");
        const int index = atoi(setting.substr(0, colon).c_str());
        if (index < 0 || index >= count) return fail("--set names an instance that is not there");
        Instance& instance = instances[index];
        const clap_id id = instance.find(setting.substr(colon + 1, equals - colon - 1).c_str());
        if (id == CLAP_INVALID_ID) return fail("--set names no parameter of the plugin");
        clap_event_param_value_t event = {};
        event.header = {sizeof(event), 0, CLAP_CORE_EVENT_SPACE_ID, CLAP_EVENT_PARAM_VALUE, 0};
        event.param_id = id;
        event.note_id = event.port_index = event.channel = event.key = -1;
        event.value = atof(setting.substr(equals + 1).c_str());
        instance.events.push_back(event);
    }

    std::vector<float> left(BLOCK), right(BLOCK);
    float* channels[2] = {left.data(), right.data()};
    clap_audio_buffer_t out = {};
    out.data32 = channels;
    out.channel_count = 2;
    clap_output_events_t out_events = {nullptr, drop_event};
    clap_event_transport_t transport = {};
    transport.header = {sizeof(transport), 0, CLAP_CORE_EVENT_SPACE_ID, CLAP_EVENT_TRANSPORT, 0};
    transport.tempo = bpm;
    transport.tsig_num = 4;
    transport.tsig_denom = 4;
    clap_process_t process = {};
    process.frames_count = BLOCK;
    process.transport = &transport;
    process.audio_outputs = &out;
    process.audio_outputs_count = 1;
    process.out_events = &out_events;
    auto run = [&](Instance& instance) {
        clap_input_events_t in_events = {&instance, event_count, event_at};
        process.in_events = &in_events;
        const bool ok = instance.plugin->process(instance.plugin, &process) != CLAP_PROCESS_ERROR;
        instance.events.clear();
        return ok;
    };

    // Stopped blocks until every instance is connected (at most 60 s: a new session is made on request).
    auto all_connected = [&] {
        for (const Instance& instance : instances)
            if (!instance.isConnected()) return false;
        return true;
    };
    for (int waited = 0; waited < 6000 && !all_connected(); ++waited) {
        transport.flags = CLAP_TRANSPORT_HAS_TEMPO | CLAP_TRANSPORT_HAS_BEATS_TIMELINE | CLAP_TRANSPORT_HAS_TIME_SIGNATURE;
        process.steady_time = -1;
        for (Instance& instance : instances) run(instance);
        timespec pause = {0, 10000000};
        nanosleep(&pause, nullptr);
    }
    if (!all_connected()) return fail("the plugin did not connect to the engine within 60 s");
    for (int waited = 0; waited < static_cast<int>(wait_s * 100); ++waited) {  // --wait: stopped, in real time
        process.steady_time = -1;
        for (Instance& instance : instances) run(instance);
        timespec pause = {0, 10000000};
        nanosleep(&pause, nullptr);
    }

    const double frames_per_beat = RATE * 60.0 / bpm;
    const int64_t total = static_cast<int64_t>(std::ceil(bars * 4 * frames_per_beat));
    const int64_t stopAt = stopAtBar < 0 ? total : static_cast<int64_t>(std::ceil(stopAtBar * 4 * frames_per_beat));
    int64_t stoppedLeft = static_cast<int64_t>(std::ceil(stopBars * 4 * frames_per_beat));
    timespec started;
    clock_gettime(CLOCK_MONOTONIC, &started);
    for (int64_t frame = 0, song = 0; frame < total; frame += BLOCK) {
        pace(started, frame, realtime);
        const bool stopped = song >= stopAt && stoppedLeft > 0;
        const double beats = song / frames_per_beat;
        transport.flags = CLAP_TRANSPORT_HAS_TEMPO | CLAP_TRANSPORT_HAS_BEATS_TIMELINE |
                          CLAP_TRANSPORT_HAS_TIME_SIGNATURE | (stopped ? 0 : CLAP_TRANSPORT_IS_PLAYING);
        transport.song_pos_beats = static_cast<clap_beattime>(std::llround(beats * CLAP_BEATTIME_FACTOR));
        transport.bar_number = static_cast<int32_t>(beats / 4);
        transport.bar_start = static_cast<clap_beattime>(transport.bar_number) * 4 * CLAP_BEATTIME_FACTOR;
        process.steady_time = frame;
        for (Instance& instance : instances) {
            if (!run(instance)) return fail("process() failed");
            for (uint32_t i = 0; i < BLOCK; ++i) {
                instance.output.push_back(left[i]);
                instance.output.push_back(right[i]);
            }
        }
        if (stopped)
            stoppedLeft -= BLOCK;
        else
            song += BLOCK;
    }
    for (Instance& instance : instances) {
        instance.plugin->stop_processing(instance.plugin);
        instance.plugin->deactivate(instance.plugin);
        instance.plugin->destroy(instance.plugin);
    }
    entry->deinit();
    for (int i = 0; i < count; ++i) {  // OUT for the first instance, OUT.1, OUT.2, ... for the others
        const std::string path = i == 0 ? std::string(argv[2]) : std::string(argv[2]) + "." + std::to_string(i);
        FILE* file = fopen(path.c_str(), "wb");
        const std::vector<float>& output = instances[i].output;
        if (file == nullptr || fwrite(output.data(), sizeof(float), output.size(), file) != output.size())
            return fail("cannot write the output");
        fclose(file);
    }
    return 0;
}
