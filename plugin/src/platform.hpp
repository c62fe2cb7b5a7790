// What the plugin needs from the operating system, in one place: platform_posix.cpp is Linux and macOS; a Windows
// build is a port of that one file (CreateFileMapping/MapViewOfFile, QueryPerformanceCounter, CreateProcess).
#pragma once
#include <stdint.h>

namespace flowjam {

struct Mapping {
    void* base = nullptr;
    uint64_t bytes = 0;
};

// Map the named shared memory (Python's multiprocessing.shared_memory name, without the leading slash) read-write.
bool map_shared(const char* name, Mapping& mapping);
void unmap_shared(Mapping& mapping);

// The engine's heartbeat clock (CLOCK_MONOTONIC, Python's time.monotonic_ns) in nanoseconds.
int64_t monotonic_ns();

// The sync clock of live/sync/clock.py (CLOCK_MONOTONIC_RAW) in seconds: a block's render time.
double sync_clock_s();

// Run `command` through the shell, detached from the host (its own session, no inherited output); false if it
// could not be started.
bool start_engine(const char* command);

void sleep_ms(int milliseconds);

// A number no other plugin instance on the machine holds now (never 0): an instance's token in the lobby.
int64_t instance_token();

// Atomically replace *slot (in shared memory) by `desired` where it still holds `expected`; true if it did.
bool compare_and_swap(int64_t* slot, int64_t expected, int64_t desired);

}  // namespace flowjam
