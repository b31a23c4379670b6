// Declarations shared between the library's sources (internal).
#pragma once

#include <initializer_list>
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

// CURVE on `socket` before it connects; only a tcp:// endpoint uses it.
void secure(zmq::socket_t& socket, const std::string& endpoint, const std::optional<ClientCurve>& curve);

}  // namespace inferd::detail
