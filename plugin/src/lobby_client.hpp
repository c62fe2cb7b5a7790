// An instance's side of the plugin lobby (live/plugin_lobby.py): on the watcher thread, never the audio thread, it
// claims a row of the engine's lobby, beats in it, asks for a session by name ("" for a new one) and reads the
// engine's answer. Its row is given back when the instance goes; a crashed host's row frees itself (ROW_STALE_S).
#pragma once
#include <stdint.h>

#include <string>

#include "platform.hpp"

namespace flowjam {

class LobbyClient {
public:
    LobbyClient();
    ~LobbyClient();

    // One round: keep the row (claimed, beating) and ask for `asked`; true, with `granted` set, once the engine has
    // answered the newest ask with a session. False while there is no live lobby (no engine) or no answer yet.
    bool keep(const std::string& asked, std::string& granted);

private:
    bool live() const;
    bool claim();
    void leave();
    int64_t* rowCounters() const;
    char* rowName(int which) const;  // 0: the asked name, 1: the granted one

    std::string name;
    Mapping mapping;
    int64_t* counters = nullptr;
    int row = -1;
    const int64_t token;
    std::string askedNow;
    int64_t askSeq = -1;  // the newest ask's sequence (-1: none made in this row)
};

}  // namespace flowjam
