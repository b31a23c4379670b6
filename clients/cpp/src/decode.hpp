// Reading msgpack maps as strictly as the JSON Schemas describe them (internal).
#pragma once

#include <msgpack.hpp>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "inferd/errors.hpp"
#include "inferd/tensor.hpp"
#include "inferd/wire.hpp"

namespace inferd::detail {

// Arrays and maps nested deeper than this are refused (MalformedReply, saying
// so): the protocol's messages nest about 8 deep (describe; build.status's phase
// tree two more per phase level), and to_json and msgpack-cxx's packing of an
// object recurse once per level (30,000 levels overflowed an 8 MiB stack). The
// Python client's msgpack refuses past 1,024; this client keeps to 64 so that a
// hostile reply's recursion stays within a small thread stack (to_json takes 560
// bytes a level optimised: 35 KiB at 64 levels, 560 KiB at 1,024).
constexpr std::size_t kMaxNesting = 64;

// One msgpack value decoded from `size` bytes: the whole buffer, nothing after it,
// and a map with string keys when `map` (as protocol.unpack_header). Its arrays
// and maps, all together, may count no more elements than the buffer has bytes,
// nor nest deeper than kMaxNesting.
msgpack::object_handle unpack(const void* data, std::size_t size, std::size_t max_bytes,
                              bool map = true);

[[noreturn]] void malformed(const std::string& what);

// The fields of one msgpack map; every accessor names the field in its error.
class Fields {
public:
    Fields(const msgpack::object& object, std::string where);

    const msgpack::object* find(std::string_view key) const;
    const msgpack::object& required(std::string_view key) const;
    // MalformedReply when the map has a key outside `known` (unevaluatedProperties: false).
    void only(std::initializer_list<std::string_view> known) const;

    std::string string(std::string_view key) const;
    std::optional<std::string> nullable_string(std::string_view key) const;
    bool boolean(std::string_view key) const;
    std::uint64_t uint(std::string_view key) const;
    std::optional<std::uint64_t> nullable_uint(std::string_view key) const;
    double number(std::string_view key) const;
    std::optional<double> nullable_number(std::string_view key) const;
    std::vector<std::string> strings(std::string_view key) const;
    Fields map(std::string_view key) const;
    std::string json(std::string_view key) const;

    const std::string& where() const { return where_; }
    const msgpack::object& object() const { return object_; }

private:
    std::string name(std::string_view key) const;
    const msgpack::object& object_;
    std::string where_;
};

std::string as_string(const msgpack::object& value, const std::string& where);
bool is_uint(const msgpack::object& value);
bool is_number(const msgpack::object& value);
double as_number(const msgpack::object& value);
std::string to_json(const msgpack::object& value);

// `v` is 1 and `id` a valid request id or null (null only when `null_id`).
wire::RequestId read_envelope(const Fields& header, bool null_id);
wire::ErrorInfo read_error(const Fields& header);
// A {name, dtype, shape} descriptor, or one of a region-backed tensor.
wire::TensorDescriptor read_descriptor(std::size_t index, const msgpack::object& value);
wire::ThermalSummary read_thermal_summary(const std::string& name, const std::string& where);

}  // namespace inferd::detail
