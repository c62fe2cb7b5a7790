// platform.hpp on POSIX (Linux, macOS).
#include "platform.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>

extern char** environ;

namespace flowjam {

bool map_shared(const char* name, Mapping& mapping) {
    char path[256];
    if (snprintf(path, sizeof(path), "/%s", name) >= static_cast<int>(sizeof(path))) return false;
    const int fd = shm_open(path, O_RDWR, 0);
    if (fd < 0) return false;
    struct stat info;
    void* base = MAP_FAILED;
    if (fstat(fd, &info) == 0 && info.st_size > 0)
        base = mmap(nullptr, static_cast<size_t>(info.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) return false;
    mapping.base = base;
    mapping.bytes = static_cast<uint64_t>(info.st_size);
    return true;
}

void unmap_shared(Mapping& mapping) {
    if (mapping.base != nullptr) munmap(mapping.base, static_cast<size_t>(mapping.bytes));
    mapping = Mapping();
}

int64_t monotonic_ns() {
    timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return static_cast<int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec;
}

double sync_clock_s() {
#ifdef CLOCK_MONOTONIC_RAW
    timespec now;
    clock_gettime(CLOCK_MONOTONIC_RAW, &now);
    return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
#else
    return 1e-9 * static_cast<double>(monotonic_ns());
#endif
}

bool start_engine(const char* command) {
    posix_spawnattr_t attr;
    posix_spawn_file_actions_t actions;
    posix_spawnattr_init(&attr);
#ifdef POSIX_SPAWN_SETSID
    posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSID);
#endif
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 0, "/dev/null", O_RDONLY, 0);
    posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&actions, 2, "/dev/null", O_WRONLY, 0);
    pid_t pid;
    char* argv[] = {const_cast<char*>("/bin/sh"), const_cast<char*>("-c"), const_cast<char*>(command), nullptr};
    const int failed = posix_spawn(&pid, "/bin/sh", &actions, &attr, argv, environ);
    posix_spawn_file_actions_destroy(&actions);
    posix_spawnattr_destroy(&attr);
    return failed == 0;
}

void sleep_ms(int milliseconds) {
    timespec wait = {milliseconds / 1000, (milliseconds % 1000) * 1000000L};
    nanosleep(&wait, nullptr);
}

int64_t instance_token() {
    static std::atomic<uint32_t> made{0};  // the process's id, then its instances counted: unique while it runs
    return (static_cast<int64_t>(getpid() & 0x7FFFFFFF) << 32) | static_cast<int64_t>(++made);
}

bool compare_and_swap(int64_t* slot, int64_t expected, int64_t desired) {
    return __atomic_compare_exchange_n(slot, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

}  // namespace flowjam
