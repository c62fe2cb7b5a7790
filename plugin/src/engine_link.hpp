// The plugin's connection to the engine: a watcher thread (never the audio thread) asks the engine's lobby for its
// session (lobby_client.hpp), attaches to the session's control block and the loop buffer it names, checks the engine's heartbeat, lets go of a stale engine and attaches again
// when it is back. The audio thread takes the current attachment with acquire() and gives it back with release();
// the watcher unmaps an attachment only once no block is using it.
#pragma once
#include <stdint.h>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>

#include "lobby_client.hpp"
#include "platform.hpp"
#include "render_core.hpp"

namespace flowjam {

struct Attachment {
    Mapping control, loop;
    int64_t* controlCounters = nullptr;
    double* controlReals = nullptr;
    double* hostValues = nullptr;
    int64_t* hostChanges = nullptr;
    const double* engineValues = nullptr;    // the engine's knob values
    const int64_t* engineChanges = nullptr;  // per knob, the values the engine came to by itself (not the host's)
    int64_t* blockTimes = nullptr;  // the plugin's time per block (block_times.hpp)
    LoopView view;
    uint64_t generation = 0;  // counts attachments: the audio thread resets its renderer on a new one
    int64_t engineId = 0;     // the control block's ENGINE_ID: the same engine attached again keeps its knobs
};

class EngineLink {
public:
    EngineLink();
    ~EngineLink();

    // The session to play ("": a new one, named by the engine's lobby once the instance is active), and the one
    // played now (the name the project saves).
    void setSession(const std::string& session);
    std::string session() const;
    // The host activated the instance: it takes part in the lobby from now on (a host's scan never does).
    void setActive();
    void setEngineCommand(const std::string& command);
    std::string engineCommand() const;

    // Prompt A, B or the negative (slot 0, 1, 2): a project's, given to the engine (prompt A set: all three); and the
    // engine's newest, for the project to save.
    void setPrompt(int slot, const std::string& text);
    std::string prompt(int slot) const;

    // Audio thread: the attachment to render from (nullptr: not connected); release() after the block.
    Attachment* acquire() noexcept;
    void release() noexcept;
    // Whether `attachment` is still the current one (false once the watcher lets go of it: a waiting block stops).
    bool holds(const Attachment* attachment) const noexcept { return current.load() == attachment; }

private:
    void watch();
    bool fresh(const Attachment& attachment) const;
    bool attach(Attachment& attachment);
    void retire();
    void exchangePrompts(Attachment& attachment, bool newEngine);

    mutable std::mutex settingsLock;
    void askLobby();

    std::string sessionName, command;
    bool sessionChanged = false;
    bool active = false;
    LobbyClient lobby;
    std::string prompts[3];
    bool pushPrompts = false;
    int64_t enginePromptsSeen = -1;  // the engine's prompt area at its newest read
    int64_t pushedSeq = 0;           // the host prompt area's sequence after our newest push to this engine
    int64_t promptsEngine = 0;       // the engine (ENGINE_ID) the project's prompts were given to
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
