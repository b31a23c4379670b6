// Declarations shared between the library's sources (internal).
#pragma once

#include <algorithm>
#include <chrono>
#include <climits>
#include <initializer_list>
#include <optional>
#include <string_view>

#include "decode.hpp"
#include "inferd/endpoints.hpp"
#include "inferd/events.hpp"

namespace zmq {
class socket_t;
}

namespace inferd::detail {

// A health snapshot from `fields`, which may also hold the `extra` keys (an event's stamp).
HealthSnapshot read_health(const Fields& fields, std::initializer_list<std::string_view> extra);

// Whether `socket` has a message within `timeout_ms` (0 or less: now), or nullopt
// when a signal handler interrupted the wait: zmq_poll returns EINTR then, as
// poll(2) does whatever SA_RESTART says, and cppzmq throws it as zmq::error_t
// (no ClientError). The caller waits again for the time left, as pyzmq does.
std::optional<bool> poll_in(zmq::socket_t& socket, long long timeout_ms);

// CURVE on `socket` before it connects; only a tcp:// endpoint uses it.
void secure(zmq::socket_t& socket, const std::string& endpoint, const std::optional<ClientCurve>& curve);

// When a wait of `wait` from now ends: saturated at the clock's end, so that a
// timeout of weeks (or milliseconds::max()) neither wraps nor overflows.
inline std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds wait) {
    using clock = std::chrono::steady_clock;
    auto now = clock::now();
    if (wait.count() <= 0) return now;
    auto room = std::chrono::duration_cast<std::chrono::milliseconds>(clock::time_point::max() - now);
    return wait >= room ? clock::time_point::max() : now + wait;
}

// The milliseconds left before `give_up_at`, rounded up (a wait never ends before
// the caller's timeout) and at most INT_MAX (what poll(2) and ZeroMQ's timeouts
// take); 0 or less once it has passed.
inline long long milliseconds_left(std::chrono::steady_clock::time_point give_up_at) {
    auto left = std::chrono::ceil<std::chrono::milliseconds>(give_up_at - std::chrono::steady_clock::now());
    return std::min<long long>(left.count(), INT_MAX);
}

}  // namespace inferd::detail
