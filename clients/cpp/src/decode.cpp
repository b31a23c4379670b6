// Strict msgpack reading (decode.hpp) and msgpack as JSON text.
#include "decode.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace inferd::detail {

void malformed(const std::string& what) { throw MalformedReply(what); }

namespace {

// Reads a msgpack value without building it, refusing it as soon as its arrays
// and maps, open at once, count more elements than the message has bytes (each
// value takes a byte at least, so the message must end first), or nest deeper
// than kMaxNesting. What it cannot parse is left to msgpack::unpack to name.
class ShapeCheck : public msgpack::null_visitor {
public:
    explicit ShapeCheck(std::size_t size) : size_(size) {}
    bool start_array(std::uint32_t elements) { return open(elements); }
    bool start_map(std::uint32_t pairs) { return open(std::uint64_t{pairs} * 2); }
    bool end_array() { return close(); }
    bool end_map() { return close(); }
    const std::string& refusal() const { return refusal_; }

private:
    bool open(std::uint64_t elements) {
        values_ += elements;
        if (values_ > size_) {
            refusal_ = "counts more array and map elements than its " + std::to_string(size_) +
                       " bytes can hold (a truncated or hostile message)";
            return false;
        }
        if (++depth_ > kMaxNesting) {
            refusal_ = "nests arrays and maps more than " + std::to_string(kMaxNesting) +
                       " deep (this client's limit; the protocol's messages nest about 10)";
            return false;
        }
        return true;
    }
    bool close() {
        --depth_;
        return true;
    }
    std::uint64_t size_;
    std::uint64_t values_ = 1;  // the value itself
    std::size_t depth_ = 0;
    std::string refusal_;
};

}  // namespace

msgpack::object_handle unpack(const void* data, std::size_t size, std::size_t max_bytes, bool map) {
    if (size == 0) malformed("header frame is empty");
    if (size > max_bytes) {
        malformed("header frame is " + std::to_string(size) + " bytes; the limit is " +
                  std::to_string(max_bytes));
    }
    // msgpack-cxx allocates an array's or map's elements (24 bytes each) when it
    // reads the count, before their bytes: the 5-byte header dd ff ff ff ff asked
    // for 96 GiB, and 64 nested counts each as big as the message reserved 1,536
    // times its size (2 GB for a 1 MB event). The check bounds them all together,
    // so what unpack reserves is at most 24 bytes per byte of the message; and
    // nesting is bounded (to_json recurses once per level).
    ShapeCheck check(size);
    std::size_t checked = 0;
    msgpack::parse(static_cast<const char*>(data), size, checked, check);
    if (!check.refusal().empty()) malformed("msgpack value " + check.refusal());
    msgpack::object_handle handle;
    std::size_t offset = 0;
    // The check holds these already; msgpack-cxx's own limits stay a second guard.
    const msgpack::unpack_limit limit(size, size / 2, size, size, size, kMaxNesting);
    try {
        handle = msgpack::unpack(static_cast<const char*>(data), size, offset, nullptr, nullptr, limit);
    } catch (const std::exception& error) {
        malformed(std::string("header is not valid msgpack: ") + error.what());
    }
    if (offset != size) malformed("header is not valid msgpack: extra data after the value");
    if (map && handle.get().type != msgpack::type::MAP) malformed("header must be a msgpack map");
    return handle;
}

Fields::Fields(const msgpack::object& object, std::string where)
    : object_(object), where_(std::move(where)) {
    if (object.type != msgpack::type::MAP) malformed(where_ + " must be a map");
    for (std::uint32_t i = 0; i < object.via.map.size; ++i) {
        if (object.via.map.ptr[i].key.type != msgpack::type::STR) {
            malformed(where_ + " has a key that is not a string");
        }
    }
}

std::string Fields::name(std::string_view key) const {
    return where_ + "." + std::string(key);
}

const msgpack::object* Fields::find(std::string_view key) const {
    for (std::uint32_t i = 0; i < object_.via.map.size; ++i) {
        const auto& entry = object_.via.map.ptr[i];
        if (std::string_view(entry.key.via.str.ptr, entry.key.via.str.size) == key) {
            return &entry.val;
        }
    }
    return nullptr;
}

const msgpack::object& Fields::required(std::string_view key) const {
    const auto* value = find(key);
    if (value == nullptr) malformed(where_ + " has no '" + std::string(key) + "'");
    return *value;
}

void Fields::only(std::initializer_list<std::string_view> known) const {
    for (std::uint32_t i = 0; i < object_.via.map.size; ++i) {
        const auto& key = object_.via.map.ptr[i].key;
        std::string_view name(key.via.str.ptr, key.via.str.size);
        bool found = false;
        for (auto candidate : known) found = found || candidate == name;
        if (!found) malformed(where_ + " has an unknown key '" + std::string(name) + "'");
    }
}

std::string as_string(const msgpack::object& value, const std::string& where) {
    if (value.type != msgpack::type::STR) malformed(where + " must be a string");
    return std::string(value.via.str.ptr, value.via.str.size);
}

bool is_uint(const msgpack::object& value) { return value.type == msgpack::type::POSITIVE_INTEGER; }

bool is_number(const msgpack::object& value) {
    return value.type == msgpack::type::POSITIVE_INTEGER ||
           value.type == msgpack::type::NEGATIVE_INTEGER ||
           value.type == msgpack::type::FLOAT32 || value.type == msgpack::type::FLOAT64;
}

double as_number(const msgpack::object& value) {
    switch (value.type) {
        case msgpack::type::POSITIVE_INTEGER: return static_cast<double>(value.via.u64);
        case msgpack::type::NEGATIVE_INTEGER: return static_cast<double>(value.via.i64);
        default: return value.via.f64;
    }
}

std::string Fields::string(std::string_view key) const {
    return as_string(required(key), name(key));
}

std::optional<std::string> Fields::nullable_string(std::string_view key) const {
    const auto& value = required(key);
    if (value.type == msgpack::type::NIL) return std::nullopt;
    return as_string(value, name(key) + " (or null)");
}

bool Fields::boolean(std::string_view key) const {
    const auto& value = required(key);
    if (value.type != msgpack::type::BOOLEAN) malformed(name(key) + " must be a boolean");
    return value.via.boolean;
}

std::uint64_t Fields::uint(std::string_view key) const {
    const auto& value = required(key);
    if (!is_uint(value)) malformed(name(key) + " must be a non-negative integer");
    return value.via.u64;
}

std::optional<std::uint64_t> Fields::nullable_uint(std::string_view key) const {
    const auto& value = required(key);
    if (value.type == msgpack::type::NIL) return std::nullopt;
    if (!is_uint(value)) malformed(name(key) + " must be a non-negative integer or null");
    return value.via.u64;
}

double Fields::number(std::string_view key) const {
    const auto& value = required(key);
    if (!is_number(value)) malformed(name(key) + " must be a number");
    return as_number(value);
}

std::optional<double> Fields::nullable_number(std::string_view key) const {
    const auto& value = required(key);
    if (value.type == msgpack::type::NIL) return std::nullopt;
    if (!is_number(value)) malformed(name(key) + " must be a number or null");
    return as_number(value);
}

std::vector<std::string> Fields::strings(std::string_view key) const {
    const auto& value = required(key);
    if (value.type != msgpack::type::ARRAY) malformed(name(key) + " must be a list of strings");
    std::vector<std::string> items;
    for (std::uint32_t i = 0; i < value.via.array.size; ++i) {
        items.push_back(as_string(value.via.array.ptr[i], name(key) + "[]"));
    }
    return items;
}

Fields Fields::map(std::string_view key) const { return Fields(required(key), name(key)); }

std::string Fields::json(std::string_view key) const { return to_json(required(key)); }

namespace {

void json_string(std::ostringstream& out, std::string_view text) {
    out << '"';
    for (unsigned char c : text) {
        switch (c) {
            case '"': out << "\\\""; break;
            case '\\': out << "\\\\"; break;
            case '\n': out << "\\n"; break;
            case '\r': out << "\\r"; break;
            case '\t': out << "\\t"; break;
            default:
                if (c < 0x20) {
                    char escaped[8];
                    std::snprintf(escaped, sizeof escaped, "\\u%04x", c);
                    out << escaped;
                } else {
                    out << c;
                }
        }
    }
    out << '"';
}

void json_value(std::ostringstream& out, const msgpack::object& value) {
    switch (value.type) {
        case msgpack::type::NIL: out << "null"; break;
        case msgpack::type::BOOLEAN: out << (value.via.boolean ? "true" : "false"); break;
        case msgpack::type::POSITIVE_INTEGER: out << value.via.u64; break;
        case msgpack::type::NEGATIVE_INTEGER: out << value.via.i64; break;
        case msgpack::type::FLOAT32:
        case msgpack::type::FLOAT64: {
            if (!std::isfinite(value.via.f64)) {
                out << "null";
                break;
            }
            char number[32];
            std::snprintf(number, sizeof number, "%.17g", value.via.f64);
            out << number;
            break;
        }
        case msgpack::type::STR:
            json_string(out, std::string_view(value.via.str.ptr, value.via.str.size));
            break;
        case msgpack::type::ARRAY:
            out << '[';
            for (std::uint32_t i = 0; i < value.via.array.size; ++i) {
                if (i) out << ',';
                json_value(out, value.via.array.ptr[i]);
            }
            out << ']';
            break;
        case msgpack::type::MAP:
            out << '{';
            for (std::uint32_t i = 0; i < value.via.map.size; ++i) {
                if (i) out << ',';
                const auto& key = value.via.map.ptr[i].key;
                if (key.type == msgpack::type::STR) {
                    json_value(out, key);
                } else {
                    std::ostringstream inner;
                    json_value(inner, key);
                    json_string(out, inner.str());
                }
                out << ':';
                json_value(out, value.via.map.ptr[i].val);
            }
            out << '}';
            break;
        default: malformed("bin and ext values never appear on the bus");
    }
}

}  // namespace

std::string to_json(const msgpack::object& value) {
    std::ostringstream out;
    json_value(out, value);
    return out.str();
}

wire::RequestId read_envelope(const Fields& header, bool null_id) {
    const auto& version = header.required("v");
    if (!is_uint(version) || version.via.u64 != wire::kProtocolVersion) {
        malformed("unsupported protocol version; this peer speaks v=1");
    }
    const auto& id = header.required("id");
    if (id.type == msgpack::type::POSITIVE_INTEGER) return id.via.u64;
    if (id.type == msgpack::type::STR && id.via.str.size > 0 &&
        id.via.str.size <= wire::kMaxIdChars) {
        return std::string(id.via.str.ptr, id.via.str.size);
    }
    if (id.type == msgpack::type::NIL && null_id) return std::monostate{};
    malformed("reply 'id' must be an unsigned 64-bit integer or a string of 1..128 characters");
}

wire::ErrorInfo read_error(const Fields& header) {
    header.only({"v", "id", "ok", "error"});
    auto error = header.map("error");
    error.only({"code", "message"});
    wire::ErrorInfo info;
    auto code = error.string("code");
    if (!parse_error_code(code, info.code)) malformed("unknown error code '" + code + "'");
    info.message = error.string("message");
    return info;
}

wire::TensorDescriptor read_descriptor(std::size_t index, const msgpack::object& value) {
    Fields fields(value, "tensor #" + std::to_string(index));
    wire::TensorDescriptor descriptor;
    descriptor.name = fields.string("name");
    if (descriptor.name.empty()) malformed(fields.where() + ": 'name' must be a non-empty string");
    descriptor.dtype = parse_dtype(fields.string("dtype"));
    const auto& shape = fields.required("shape");
    if (shape.type != msgpack::type::ARRAY || shape.via.array.size > wire::kMaxDimensions) {
        malformed(fields.where() + ": 'shape' must be a list of at most 16 dimensions");
    }
    for (std::uint32_t i = 0; i < shape.via.array.size; ++i) {
        const auto& dimension = shape.via.array.ptr[i];
        if (!is_uint(dimension) || dimension.via.u64 >= (1ULL << 31)) {
            // The bound named, as the Python client's message does.
            malformed(fields.where() + ": shape must hold non-negative integers up to " +
                      std::to_string((1ULL << 31) - 1));
        }
        descriptor.shape.push_back(static_cast<std::int64_t>(dimension.via.u64));
    }
    // Sixteen dimensions below 2^31 can still multiply past 2^64: a wrapped size
    // would let a short frame (or region) pass for the tensor.
    std::size_t bytes = itemsize(descriptor.dtype);
    bool overflow = false;
    for (auto dimension : descriptor.shape) {
        overflow = __builtin_mul_overflow(bytes, static_cast<std::size_t>(dimension), &bytes) || overflow;
    }
    bool empty = std::find(descriptor.shape.begin(), descriptor.shape.end(), 0) != descriptor.shape.end();
    if (overflow && !empty) {
        malformed(fields.where() + ": its shape needs more than 2^64 bytes");
    }
    if (fields.find("region") == nullptr) {
        fields.only({"name", "dtype", "shape"});
        return descriptor;
    }
    fields.only({"name", "dtype", "shape", "region", "offset", "nbytes"});
    wire::RegionRef ref;
    ref.region = fields.string("region");
    bool hex = ref.region.size() == 32;
    for (char c : ref.region) hex = hex && ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'));
    if (!hex) malformed(fields.where() + ": 'region' must be 32 lowercase hex digits");
    ref.offset = fields.uint("offset");
    ref.nbytes = fields.uint("nbytes");
    if (ref.offset % wire::kRegionAlignment) malformed(fields.where() + ": offset is not aligned");
    descriptor.region = ref;
    return descriptor;
}

wire::ThermalSummary read_thermal_summary(const std::string& name, const std::string& where) {
    if (name == "nominal") return wire::ThermalSummary::Nominal;
    if (name == "throttling") return wire::ThermalSummary::Throttling;
    if (name == "unknown") return wire::ThermalSummary::Unknown;
    malformed(where + " must be nominal, throttling or unknown");
}

}  // namespace inferd::detail
