#include "engine_link.hpp"

#include <algorithm>
#include <cstring>

#include "flowjam_generated.h"

namespace flowjam {

namespace {
constexpr int CHECK_MS = 100;
constexpr int64_t START_EVERY_NS = 30000000000LL;  // the engine command runs at most every 30 s
}  // namespace

EngineLink::EngineLink() : thread([this] { watch(); }) {}

EngineLink::~EngineLink() {
    stopping = true;
    thread.join();
    retire();
}

void EngineLink::setSession(const std::string& session) {
    std::lock_guard<std::mutex> guard(settingsLock);
    if (session != sessionName) {
        sessionName = session;
        sessionChanged = true;
    }
}

std::string EngineLink::session() const {
    std::lock_guard<std::mutex> guard(settingsLock);
    return sessionName;
}

void EngineLink::setActive() {
    std::lock_guard<std::mutex> guard(settingsLock);
    active = true;
}

// The session asked of the lobby: the one named (a project's, $FLOWJAM_SESSION), or a new one whose name the engine
// gives and this instance plays and saves from then on.
void EngineLink::askLobby() {
    std::string asked;
    {
        std::lock_guard<std::mutex> guard(settingsLock);
        if (!active) return;
        asked = sessionName;
    }
    std::string granted;
    if (!lobby.keep(asked, granted) || granted == asked) return;
    std::lock_guard<std::mutex> guard(settingsLock);
    if (sessionName == asked) {  // not since set by the host (a project's state): the engine's name from now on
        sessionName = granted;
        sessionChanged = true;
    }
}

void EngineLink::setEngineCommand(const std::string& value) {
    std::lock_guard<std::mutex> guard(settingsLock);
    command = value;
}

std::string EngineLink::engineCommand() const {
    std::lock_guard<std::mutex> guard(settingsLock);
    return command;
}

void EngineLink::setPrompt(int slot, const std::string& text) {
    std::lock_guard<std::mutex> guard(settingsLock);
    prompts[slot] = text;
    pushPrompts = !prompts[0].empty();
}

std::string EngineLink::prompt(int slot) const {
    std::lock_guard<std::mutex> guard(settingsLock);
    return prompts[slot];
}

// The project's prompts to the engine (when set, and again on attaching to a new engine: a restarted engine gets them
// back; the same engine back after a stall keeps what it plays), and the engine's prompts back once they answer our
// newest push (the engine says which of our pushes it had taken in: what it wrote before is older than the
// project's). Both areas are sequence-locked.
void EngineLink::exchangePrompts(Attachment& a, bool newEngine) {
    auto* base = static_cast<char*>(a.control.base);
    int64_t* counters = a.controlCounters;
    std::lock_guard<std::mutex> guard(settingsLock);
    if (newEngine) {
        pushedSeq = 0;
        enginePromptsSeen = -1;
    }
    if ((pushPrompts || newEngine) && !prompts[0].empty()) {
        const int64_t seq = counters[control::HOST_PROMPTS_SEQ];
        __atomic_store_n(&counters[control::HOST_PROMPTS_SEQ], seq + 1, __ATOMIC_SEQ_CST);
        for (int slot = 0; slot < control::PROMPT_COUNT; ++slot) {
            char* area = base + control::HOST_PROMPTS_OFFSET + slot * control::PROMPT_BYTES;
            const size_t size = std::min<size_t>(prompts[slot].size(), control::PROMPT_BYTES - 1);
            std::memcpy(area, prompts[slot].data(), size);
            area[size] = '\0';
        }
        __atomic_store_n(&counters[control::HOST_PROMPTS_SEQ], seq + 2, __ATOMIC_SEQ_CST);
        pushPrompts = false;
        pushedSeq = seq + 2;
        return;
    }
    const int64_t before = __atomic_load_n(&counters[control::ENGINE_PROMPTS_SEQ], __ATOMIC_SEQ_CST);
    if (before == enginePromptsSeen || before % 2 != 0 || before == 0) return;
    const int64_t taken = __atomic_load_n(&counters[control::ENGINE_PROMPTS_TAKEN], __ATOMIC_SEQ_CST);
    std::string read[3];
    for (int slot = 0; slot < control::PROMPT_COUNT; ++slot) {
        const char* area = base + control::ENGINE_PROMPTS_OFFSET + slot * control::PROMPT_BYTES;
        read[slot].assign(area, strnlen(area, control::PROMPT_BYTES - 1));
    }
    if (__atomic_load_n(&counters[control::ENGINE_PROMPTS_SEQ], __ATOMIC_SEQ_CST) != before) return;  // torn: later
    if (taken < pushedSeq) return;  // written before the engine took our push in: its answer comes later
    for (int slot = 0; slot < control::PROMPT_COUNT; ++slot) prompts[slot] = read[slot];
    enginePromptsSeen = before;
}

Attachment* EngineLink::acquire() noexcept {
    busy.store(true);
    return current.load();
}

void EngineLink::release() noexcept { busy.store(false); }

bool EngineLink::fresh(const Attachment& attachment) const {
    const int64_t beat = attachment.controlCounters[control::HEARTBEAT_NS];
    return beat > 0 && monotonic_ns() - beat < static_cast<int64_t>(control::STALE_AFTER_S * 1e9);
}

bool EngineLink::attach(Attachment& a) {
    std::string name;
    {
        std::lock_guard<std::mutex> guard(settingsLock);
        if (sessionName.empty()) return false;  // a new instance: the lobby names its session first
        name = std::string(control::PREFIX) + sessionName;
        sessionChanged = false;
    }
    if (!map_shared(name.c_str(), a.control)) return false;
    auto* base = static_cast<char*>(a.control.base);
    a.controlCounters = reinterpret_cast<int64_t*>(base);
    a.controlReals = reinterpret_cast<double*>(base + control::REALS_OFFSET);
    a.hostValues = reinterpret_cast<double*>(base + control::HOST_VALUES_OFFSET);
    a.hostChanges = reinterpret_cast<int64_t*>(base + control::HOST_CHANGES_OFFSET);
    a.engineValues = reinterpret_cast<const double*>(base + control::ENGINE_VALUES_OFFSET);
    a.engineChanges = reinterpret_cast<const int64_t*>(base + control::ENGINE_CHANGES_OFFSET);
    a.blockTimes = reinterpret_cast<int64_t*>(base + control::BLOCK_TIMES_OFFSET);
    const bool valid = a.control.bytes >= static_cast<uint64_t>(control::SIZE_OFFSET) &&
                       a.controlCounters[control::MAGIC] == control::MAGIC_VALUE &&
                       a.controlCounters[control::VERSION] == control::VERSION_VALUE;
    if (valid && fresh(a)) {
        char bufferName[control::NAME_BYTES];
        bufferSeq = a.controlCounters[control::BUFFER_SEQ];
        std::memcpy(bufferName, base + control::NAME_OFFSET, sizeof(bufferName));
        bufferName[sizeof(bufferName) - 1] = '\0';
        if (bufferName[0] != '\0' && map_shared(bufferName, a.loop) && loop_view(a.loop.base, a.loop.bytes, a.view)) {
            a.generation = ++generations;
            a.engineId = a.controlCounters[control::ENGINE_ID];
            return true;
        }
        unmap_shared(a.loop);
    }
    unmap_shared(a.control);
    return false;
}

void EngineLink::retire() {
    Attachment* old = current.exchange(nullptr);
    if (old == nullptr) return;
    for (int waited = 0; busy.load() && waited < 1000; ++waited) sleep_ms(1);  // the block using it ends
    unmap_shared(old->loop);
    unmap_shared(old->control);
}

void EngineLink::watch() {
    int64_t disconnectedSince = monotonic_ns();
    while (!stopping) {
        askLobby();
        Attachment* attached = current.load();
        bool changed;
        {
            std::lock_guard<std::mutex> guard(settingsLock);
            changed = sessionChanged;
        }
        if (attached != nullptr &&
            (changed || !fresh(*attached) || attached->controlCounters[control::BUFFER_SEQ] != bufferSeq)) {
            retire();
            attached = nullptr;
            disconnectedSince = monotonic_ns();
        }
        if (attached == nullptr) {
            Attachment& slot = slots[next];
            if (attach(slot)) {
                next = 1 - next;
                exchangePrompts(slot, slot.engineId != promptsEngine);
                promptsEngine = slot.engineId;
                current.store(&slot);
            } else {
                const std::string start = engineCommand();
                const int64_t now = monotonic_ns();
                if (!start.empty() && now - disconnectedSince > 2000000000LL && now - lastStartNs > START_EVERY_NS) {
                    lastStartNs = now;
                    start_engine(start.c_str());
                }
            }
        }
        if (attached != nullptr) exchangePrompts(*attached, false);
        sleep_ms(CHECK_MS);
    }
}

}  // namespace flowjam
