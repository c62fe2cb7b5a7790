// The render core behind a C interface, for tests/test_plugin_parity.py (ctypes) to run it over a LoopBuffer, the
// plugin's offline detection (host_pace.hpp) for tests/test_plugin_pace.py, and the block-time bins, for
// tests/test_plugin_soak.py to hold against live/plugin_link.py's.
#include "block_times.hpp"
#include "host_pace.hpp"
#include "render_core.hpp"

using flowjam::LoopView;
using flowjam::RenderState;

struct FlowjamCore {
    RenderState state;
    LoopView view;
};

extern "C" {

FlowjamCore* flowjam_core_new(int blocksize, int channels, int sampleRate) {
    auto* core = new FlowjamCore();
    flowjam::render_prepare(core->state, blocksize, channels, sampleRate);
    return core;
}

int flowjam_core_attach(FlowjamCore* core, void* base, unsigned long long bytes) {
    if (!flowjam::loop_view(base, bytes, core->view)) return 0;
    flowjam::render_attach(core->state, core->view);
    return 1;
}

void flowjam_core_render(FlowjamCore* core, float* out, int frames, double nowS) {
    flowjam::render_block(core->state, core->view, out, frames, nowS);
}

void flowjam_core_free(FlowjamCore* core) { delete core; }

int flowjam_block_time_bin(long long ns) { return flowjam::block_time_bin(ns); }

flowjam::HostPace* flowjam_pace_new(int maxBlockFrames, double sampleRate) {
    auto* pace = new flowjam::HostPace();
    pace->prepare(maxBlockFrames, sampleRate);
    return pace;
}

int flowjam_pace_block(flowjam::HostPace* pace, long long nowNs, int frames) { return pace->block(nowNs, frames); }

void flowjam_pace_held(flowjam::HostPace* pace, long long ns) { pace->held(ns); }

void flowjam_pace_free(flowjam::HostPace* pace) { delete pace; }
}
