// A minimal CLAP host for the tests (no CLAP host installs here): loads a .clap, finds the plugin's parameters by
// name, plays `bars` bars of 4/4 at `bpm` through its process() with the host transport every block, and writes the
// stereo output as interleaved float32 to a file. Before playing it runs stopped blocks until the plugin's
// `connected` parameter reads 1 (at most 5 s). NAME=VALUE sets a parameter (in its own units) before the first block;
// stop=AT:FOR stops the transport at the first block from song bar AT (bar 1 = 0) for FOR bars of blocks, its song
// position standing, then plays on from there (the output holds every block, stopped ones too).
//   clap_render PLUGIN.clap OUT.f32 BPM BARS [NAME=VALUE ...] [stop=AT:FOR]
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

std::vector<clap_event_param_value_t> pending;  // parameter changes for the next process() call

uint32_t event_count(const clap_input_events_t*) { return static_cast<uint32_t>(pending.size()); }
const clap_event_header_t* event_at(const clap_input_events_t*, uint32_t index) { return &pending[index].header; }
bool drop_event(const clap_output_events_t*, const clap_event_header_t*) { return true; }

int fail(const char* what) {
    fprintf(stderr, "clap_render: %s\n", what);
    return 1;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 5) return fail("usage: clap_render PLUGIN.clap OUT.f32 BPM BARS [NAME=VALUE ...] [stop=AT:FOR]");
    const double bpm = atof(argv[3]);
    const int bars = atoi(argv[4]);
    double stopAtBar = -1.0, stopBars = 0.0;
    void* library = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (library == nullptr) return fail(dlerror());
    auto* entry = static_cast<const clap_plugin_entry_t*>(dlsym(library, "clap_entry"));
    if (entry == nullptr || !entry->init(argv[1])) return fail("no clap_entry, or it did not init");
    auto* factory = static_cast<const clap_plugin_factory_t*>(entry->get_factory(CLAP_PLUGIN_FACTORY_ID));
    if (factory == nullptr || factory->get_plugin_count(factory) < 1) return fail("no plugin in the factory");
    const clap_plugin_descriptor_t* descriptor = factory->get_plugin_descriptor(factory, 0);
    const clap_plugin_t* plugin = factory->create_plugin(factory, &HOST, descriptor->id);
    if (plugin == nullptr || !plugin->init(plugin)) return fail("the plugin did not init");
    auto* params = static_cast<const clap_plugin_params_t*>(plugin->get_extension(plugin, CLAP_EXT_PARAMS));
    if (params == nullptr) return fail("the plugin has no parameters extension");
    auto find = [&](const char* name) {
        for (uint32_t i = 0; i < params->count(plugin); ++i) {
            clap_param_info_t info;
            if (params->get_info(plugin, i, &info) && strcmp(info.name, name) == 0) return info.id;
        }
        return static_cast<clap_id>(CLAP_INVALID_ID);
    };
    const clap_id connected = find("connected");
    if (connected == CLAP_INVALID_ID) return fail("no parameter named connected");
    for (int i = 5; i < argc; ++i) {
        const char* equals = strchr(argv[i], '=');
        if (equals == nullptr) return fail("an option is NAME=VALUE or stop=AT:FOR");
        const std::string name(argv[i], static_cast<size_t>(equals - argv[i]));
        if (name == "stop") {
            if (sscanf(equals + 1, "%lf:%lf", &stopAtBar, &stopBars) != 2) return fail("stop=AT:FOR takes two bars");
            continue;
        }
        clap_event_param_value_t event = {};
        event.header = {sizeof(event), 0, CLAP_CORE_EVENT_SPACE_ID, CLAP_EVENT_PARAM_VALUE, 0};
        event.param_id = find(name.c_str());
        if (event.param_id == CLAP_INVALID_ID) return fail("no parameter of that name");
        event.note_id = event.port_index = event.channel = event.key = -1;
        event.value = atof(equals + 1);
        pending.push_back(event);
    }
    if (!plugin->activate(plugin, RATE, BLOCK, BLOCK) || !plugin->start_processing(plugin))
        return fail("the plugin did not activate");

    std::vector<float> left(BLOCK), right(BLOCK), output;
    float* channels[2] = {left.data(), right.data()};
    clap_audio_buffer_t out = {};
    out.data32 = channels;
    out.channel_count = 2;
    clap_input_events_t in_events = {nullptr, event_count, event_at};
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
    process.in_events = &in_events;
    process.out_events = &out_events;

    double value = 0.0;
    for (int waited = 0; waited < 500 && !(params->get_value(plugin, connected, &value) && value == 1.0); ++waited) {
        transport.flags = CLAP_TRANSPORT_HAS_TEMPO | CLAP_TRANSPORT_HAS_BEATS_TIMELINE | CLAP_TRANSPORT_HAS_TIME_SIGNATURE;
        process.steady_time = -1;
        plugin->process(plugin, &process);
        pending.clear();
        timespec pause = {0, 10000000};
        nanosleep(&pause, nullptr);
    }
    if (value != 1.0) return fail("the plugin did not connect to the engine within 5 s");

    const double frames_per_beat = RATE * 60.0 / bpm;
    const int64_t total = static_cast<int64_t>(std::ceil(bars * 4 * frames_per_beat));
    const int64_t stopAt = stopAtBar < 0 ? total : static_cast<int64_t>(std::ceil(stopAtBar * 4 * frames_per_beat));
    int64_t stoppedLeft = static_cast<int64_t>(std::ceil(stopBars * 4 * frames_per_beat));
    for (int64_t frame = 0, song = 0; frame < total; frame += BLOCK) {
        const bool stopped = song >= stopAt && stoppedLeft > 0;
        const double beats = song / frames_per_beat;
        transport.flags = CLAP_TRANSPORT_HAS_TEMPO | CLAP_TRANSPORT_HAS_BEATS_TIMELINE |
                          CLAP_TRANSPORT_HAS_TIME_SIGNATURE | (stopped ? 0 : CLAP_TRANSPORT_IS_PLAYING);
        transport.song_pos_beats = static_cast<clap_beattime>(std::llround(beats * CLAP_BEATTIME_FACTOR));
        transport.bar_number = static_cast<int32_t>(beats / 4);
        transport.bar_start = static_cast<clap_beattime>(transport.bar_number) * 4 * CLAP_BEATTIME_FACTOR;
        process.steady_time = frame;
        if (plugin->process(plugin, &process) == CLAP_PROCESS_ERROR) return fail("process() failed");
        if (stopped)
            stoppedLeft -= BLOCK;
        else
            song += BLOCK;
        for (uint32_t i = 0; i < BLOCK; ++i) {
            output.push_back(left[i]);
            output.push_back(right[i]);
        }
    }
    plugin->stop_processing(plugin);
    plugin->deactivate(plugin);
    plugin->destroy(plugin);
    entry->deinit();
    FILE* file = fopen(argv[2], "wb");
    if (file == nullptr || fwrite(output.data(), sizeof(float), output.size(), file) != output.size())
        return fail("cannot write the output");
    fclose(file);
    return 0;
}
