#include "lobby_client.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "flowjam_generated.h"

namespace flowjam {

LobbyClient::LobbyClient() : token(instance_token()) {
    const char* named = std::getenv(lobby::NAME_ENV);
    name = named != nullptr && named[0] != '\0' ? named : lobby::DEFAULT_NAME;
}

LobbyClient::~LobbyClient() { leave(); }

int64_t* LobbyClient::rowCounters() const {
    return reinterpret_cast<int64_t*>(static_cast<char*>(mapping.base) + lobby::ROWS_OFFSET + row * lobby::ROW_BYTES);
}

char* LobbyClient::rowName(int which) const {
    return reinterpret_cast<char*>(rowCounters() + lobby::ROW_COUNTERS) + which * lobby::NAME_BYTES;
}

// The engine's lobby, mapped and beating (its heartbeat no older than the control block's staleness).
bool LobbyClient::live() const {
    const int64_t beat = __atomic_load_n(&counters[lobby::HEARTBEAT_NS], __ATOMIC_SEQ_CST);
    return beat > 0 && monotonic_ns() - beat < static_cast<int64_t>(control::STALE_AFTER_S * 1e9);
}

// A free row, or one whose owner stopped beating, taken with a compare-and-swap of its token.
bool LobbyClient::claim() {
    const int64_t now = monotonic_ns();
    for (int r = 0; r < lobby::ROWS; ++r) {
        row = r;
        int64_t* c = rowCounters();
        const int64_t owner = __atomic_load_n(&c[lobby::TOKEN], __ATOMIC_SEQ_CST);
        const bool stale = now - c[lobby::BEAT_NS] > static_cast<int64_t>(lobby::ROW_STALE_S * 1e9);
        if ((owner == 0 || stale) && compare_and_swap(&c[lobby::TOKEN], owner, token)) {
            __atomic_store_n(&c[lobby::BEAT_NS], now, __ATOMIC_SEQ_CST);
            askSeq = -1;
            return true;
        }
    }
    row = -1;
    return false;
}

void LobbyClient::leave() {
    if (row >= 0 && counters != nullptr) compare_and_swap(&rowCounters()[lobby::TOKEN], token, 0);
    row = -1;
    counters = nullptr;
    unmap_shared(mapping);
}

bool LobbyClient::keep(const std::string& asked, std::string& granted) {
    if (counters != nullptr && (!live() || __atomic_load_n(&rowCounters()[lobby::TOKEN], __ATOMIC_SEQ_CST) != token))
        leave();  // the engine went (a new one makes a new lobby), or our row was taken as stale: start again
    if (counters == nullptr) {
        if (!map_shared(name.c_str(), mapping)) return false;
        counters = static_cast<int64_t*>(mapping.base);
        const bool valid = mapping.bytes >= static_cast<uint64_t>(lobby::SIZE) &&
                           counters[lobby::MAGIC] == lobby::MAGIC_VALUE &&
                           counters[lobby::VERSION] == lobby::VERSION_VALUE;
        if (!valid || !live() || !claim()) {
            leave();
            return false;
        }
    }
    int64_t* c = rowCounters();
    __atomic_store_n(&c[lobby::BEAT_NS], monotonic_ns(), __ATOMIC_SEQ_CST);
    if (askSeq < 0 || asked != askedNow) {
        char* area = rowName(0);
        const size_t size = std::min<size_t>(asked.size(), lobby::NAME_BYTES - 1);
        std::memcpy(area, asked.data(), size);
        area[size] = '\0';
        askSeq = c[lobby::ASK_SEQ] + 1;
        askedNow = asked;
        __atomic_store_n(&c[lobby::ASK_SEQ], askSeq, __ATOMIC_SEQ_CST);
    }
    if (__atomic_load_n(&c[lobby::GRANT_SEQ], __ATOMIC_SEQ_CST) != askSeq) return false;
    const char* answer = rowName(1);
    granted.assign(answer, strnlen(answer, lobby::NAME_BYTES - 1));
    return !granted.empty();
}

}  // namespace flowjam
