// Declarations shared between the library's sources (internal).
#pragma once

#include <initializer_list>
#include <string_view>

#include "decode.hpp"
#include "inferd/events.hpp"

namespace inferd::detail {

// A health snapshot from `fields`, which may also hold the `extra` keys (an event's stamp).
HealthSnapshot read_health(const Fields& fields, std::initializer_list<std::string_view> extra);

}  // namespace inferd::detail
