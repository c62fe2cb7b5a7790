// The plugin's connection to the engine: a watcher thread (never the audio thread) attaches to the session's control
// block and the loop buffer it names, checks the engine's heartbeat, lets go of a stale engine and attaches again
// when it is back. The audio thread takes the current attachment with acquire() and gives it back with release();
// the watcher unmaps an attachment only once no block is using it.
#pragma once
#include <stdint.h>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>

#include "platform.hpp"
#include "render_core.hpp"

namespace flowjam {

struct Attachment {
    Mapping control, loop;
    int64_t* controlCounters = nullptr;
    double* controlReals = nullptr;
    double* hostValues = nullptr;
    int64_t* hostChanges = nullptr;
    LoopView view;
    uint64_t generation = 0;  // counts attachments: the audio thread resets its renderer on a new one
};

class EngineLink {
public:
    EngineLink();
    ~EngineLink();

    void setSession(const std::string& session);
    void setEngineCommand(const std::string& command);
    std::string engineCommand() const;

    // Audio thread: the attachment to render from (nullptr: not connected); release() after the block.
    Attachment* acquire() noexcept;
    void release() noexcept;

private:
    void watch();
    bool fresh(const Attachment& attachment) const;
    bool attach(Attachment& attachment);
    void retire();

    mutable std::mutex settingsLock;
    std::string sessionName = "default", command;
    bool sessionChanged = false;
    Attachment slots[2];
    int next = 0;
    uint64_t generations = 0;
    int64_t bufferSeq = 0;
    std::atomic<Attachment*> current{nullptr};
    std::atomic<bool> busy{false};
    std::atomic<bool> stopping{false};
    int64_t lastStartNs = 0;
    std::thread thread;
};

}  // namespace flowjam
