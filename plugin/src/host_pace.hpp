// Whether the host renders offline (a bounce), told by its pace. DPF 1.6 passes no offline flag: its VST3 wrapper
// drops the process mode (a TODO in DistrhoPluginVST3.cpp), its CLAP wrapper offers no render extension, its LV2
// wrapper reads no freeWheeling port. A host playing to a sound card asks for at most one period of audio per period,
// so two of its largest blocks of audio take it about one period at least (half their length; a late wake-up shortens
// one gap, never the sum); a host that asks for them four times faster than real time is not playing them. The
// plugin's own waits are not the host's time. Fixed arrays, no allocation, no system call.
#pragma once
#include <stdint.h>

namespace flowjam {

class HostPace {
public:
    static constexpr double kOfflineSpeed = 4.0;  // audio per wall-clock time above which the host is offline

    void prepare(int maxBlockFrames, double sampleRate) {
        windowFrames = 2 * static_cast<int64_t>(maxBlockFrames);
        rate = sampleRate;
        count = next = 0;
        lastNs = -1;
        heldNs = 0;
    }

    // At the start of a block of `frames` at `nowNs` (CLOCK_MONOTONIC): whether the host renders offline now.
    bool block(int64_t nowNs, int frames) {
        if (lastNs >= 0) {
            const int64_t gap = nowNs - lastNs - heldNs;
            gapNs[next] = gap > 0 ? gap : 0;
            gapFrames[next] = lastFrames;
            next = (next + 1) % kBlocks;
            count = count < kBlocks ? count + 1 : kBlocks;
        }
        lastNs = nowNs;
        lastFrames = frames;
        heldNs = 0;
        int64_t framesSeen = 0, wallNs = 0;
        for (int back = 1; back <= count && framesSeen < windowFrames; ++back) {
            const int slot = (next - back + kBlocks) % kBlocks;
            framesSeen += gapFrames[slot];
            wallNs += gapNs[slot];
        }
        if (framesSeen < windowFrames || rate <= 0.0) return false;  // too little seen yet: real time
        return static_cast<double>(wallNs) * kOfflineSpeed < framesSeen / rate * 1e9;
    }

    // The plugin held the block that started last for `ns` (waiting for the engine): not the host's time.
    void held(int64_t ns) { heldNs += ns; }

private:
    static constexpr int kBlocks = 64;
    int64_t gapNs[kBlocks] = {};
    int gapFrames[kBlocks] = {};
    int count = 0, next = 0, lastFrames = 0;
    int64_t lastNs = -1, heldNs = 0, windowFrames = 0;
    double rate = 0.0;
};

}  // namespace flowjam
