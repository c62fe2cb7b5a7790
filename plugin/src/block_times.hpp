// The plugin's time per block, counted in the control block for `flowjam bench plugin` (live/plugin_link.py reads
// it): the slowest block's nanoseconds and a histogram of four bins per octave. Audio thread: no lock, no call.
#pragma once
#include <stdint.h>

#include "flowjam_generated.h"

namespace flowjam {

// The histogram bin of a block that took `ns` nanoseconds (live/plugin_link.py `block_time_bin`).
inline int block_time_bin(int64_t ns) {
    if (ns < 4) return ns < 0 ? 0 : static_cast<int>(ns);
    const int top = 63 - __builtin_clzll(static_cast<uint64_t>(ns));
    const int bin = 4 * (top - 1) + static_cast<int>((ns >> (top - 2)) & 3);
    return bin < control::BLOCK_TIME_BINS ? bin : control::BLOCK_TIME_BINS - 1;
}

// One block's time into the control block's BLOCK_TIMES (the plugin is their only writer).
inline void record_block_time(int64_t* times, int64_t ns) {
    if (ns > times[control::BLOCK_TIME_MAX_NS]) times[control::BLOCK_TIME_MAX_NS] = ns;
    times[1 + block_time_bin(ns)] += 1;
}

}  // namespace flowjam
