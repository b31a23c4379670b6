// A minimal JSON writer for the test programs' canonical output.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace inferd::testing {

inline std::string quote(const std::string& text) {
    std::string out = "\"";
    for (unsigned char c : text) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += static_cast<char>(c);
        } else if (c < 0x20) {
            char escaped[8];
            std::snprintf(escaped, sizeof escaped, "\\u%04x", c);
            out += escaped;
        } else {
            out += static_cast<char>(c);
        }
    }
    return out + "\"";
}

inline std::string number(double value) {
    char text[32];
    std::snprintf(text, sizeof text, "%.17g", value);
    return text;
}

// {"key": value, ...} from already rendered values, in insertion order.
class Object {
public:
    Object& raw(const std::string& key, const std::string& json) {
        items_.push_back(quote(key) + ":" + json);
        return *this;
    }
    Object& str(const std::string& key, const std::string& value) { return raw(key, quote(value)); }
    Object& str(const std::string& key, const std::optional<std::string>& value) {
        return raw(key, value ? quote(*value) : "null");
    }
    Object& boolean(const std::string& key, bool value) { return raw(key, value ? "true" : "false"); }
    Object& uint(const std::string& key, std::uint64_t value) { return raw(key, std::to_string(value)); }
    Object& uint(const std::string& key, const std::optional<std::uint64_t>& value) {
        return raw(key, value ? std::to_string(*value) : "null");
    }
    Object& num(const std::string& key, double value) { return raw(key, number(value)); }
    Object& num(const std::string& key, const std::optional<double>& value) {
        return raw(key, value ? number(*value) : "null");
    }
    Object& strings(const std::string& key, const std::vector<std::string>& values) {
        std::string json = "[";
        for (std::size_t i = 0; i < values.size(); ++i) json += (i ? "," : "") + quote(values[i]);
        return raw(key, json + "]");
    }
    std::string str() const {
        std::string json = "{";
        for (std::size_t i = 0; i < items_.size(); ++i) json += (i ? "," : "") + items_[i];
        return json + "}";
    }

private:
    std::vector<std::string> items_;
};

inline std::string array(const std::vector<std::string>& rendered) {
    std::string json = "[";
    for (std::size_t i = 0; i < rendered.size(); ++i) json += (i ? "," : "") + rendered[i];
    return json + "]";
}

}  // namespace inferd::testing
