#include "inferd/wire.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string_view>

#include "decode.hpp"

namespace inferd::wire {
namespace {

using Packer = msgpack::packer<msgpack::sbuffer>;

void pack_text(Packer& packer, std::string_view text) {
    packer.pack_str(static_cast<std::uint32_t>(text.size()));
    packer.pack_str_body(text.data(), static_cast<std::uint32_t>(text.size()));
}

void pack_descriptor(Packer& packer, const TensorDescriptor& descriptor) {
    packer.pack_map(descriptor.region ? 6 : 3);
    pack_text(packer, "name");
    pack_text(packer, descriptor.name);
    pack_text(packer, "dtype");
    pack_text(packer, dtype_name(descriptor.dtype));
    pack_text(packer, "shape");
    packer.pack_array(static_cast<std::uint32_t>(descriptor.shape.size()));
    for (auto dimension : descriptor.shape) packer.pack_int64(dimension);
    if (descriptor.region) {
        pack_text(packer, "region");
        pack_text(packer, descriptor.region->region);
        pack_text(packer, "offset");
        packer.pack_uint64(descriptor.region->offset);
        pack_text(packer, "nbytes");
        packer.pack_uint64(descriptor.region->nbytes);
    }
}

std::string bytes(const msgpack::sbuffer& buffer) { return std::string(buffer.data(), buffer.size()); }

}  // namespace

// Key order as the Python client builds its header: the id is set last, by the
// request channel, for every attempt.
std::string encode_infer_request(const InferRequest& request) {
    msgpack::sbuffer buffer;
    Packer packer(buffer);
    std::uint32_t keys = 5 + (request.outputs.empty() ? 0 : 1) + (request.deadline_ms ? 1 : 0) +
                         (request.max_reply_frame_bytes ? 1 : 0);
    packer.pack_map(keys);
    pack_text(packer, "v");
    packer.pack_int(kProtocolVersion);
    pack_text(packer, "op");
    pack_text(packer, "infer");
    pack_text(packer, "model");
    pack_text(packer, request.model);
    pack_text(packer, "inputs");
    packer.pack_array(static_cast<std::uint32_t>(request.inputs.size()));
    for (const auto& input : request.inputs) pack_descriptor(packer, input);
    if (!request.outputs.empty()) {
        pack_text(packer, "outputs");
        packer.pack_array(static_cast<std::uint32_t>(request.outputs.size()));
        for (const auto& output : request.outputs) pack_descriptor(packer, output);
    }
    if (request.deadline_ms) {
        pack_text(packer, "deadline_ms");
        packer.pack_uint32(*request.deadline_ms);
    }
    if (request.max_reply_frame_bytes) {
        pack_text(packer, "max_reply_frame_bytes");
        packer.pack_uint64(static_cast<std::uint64_t>(*request.max_reply_frame_bytes));
    }
    pack_text(packer, "id");
    packer.pack_uint64(request.id);
    return bytes(buffer);
}

std::string encode_describe_request(std::uint64_t id) {
    return encode_control_request(id, "describe", {});
}

std::string encode_control_request(std::uint64_t id, const std::string& op,
                                   const ControlArguments& arguments) {
    msgpack::sbuffer buffer;
    Packer packer(buffer);
    packer.pack_map(static_cast<std::uint32_t>(3 + arguments.size()));
    pack_text(packer, "v");
    packer.pack_int(kProtocolVersion);
    pack_text(packer, "op");
    pack_text(packer, op);
    for (const auto& [key, value] : arguments) {
        pack_text(packer, key);
        if (const auto* text = std::get_if<std::string>(&value)) {
            pack_text(packer, *text);
        } else if (const auto* number = std::get_if<std::int64_t>(&value)) {
            packer.pack_int64(*number);
        } else {
            std::get<bool>(value) ? packer.pack_true() : packer.pack_false();
        }
    }
    pack_text(packer, "id");
    packer.pack_uint64(id);
    return bytes(buffer);
}

RequestId decode_reply_id(const void* data, std::size_t size) {
    auto handle = detail::unpack(data, size, kMaxHeaderBytes);
    return detail::read_envelope(detail::Fields(handle.get(), "reply"), true);
}

namespace {

// ok: true with `result`-less fields, or ok: false with an error.
bool read_ok(const detail::Fields& header) {
    const auto& ok = header.required("ok");
    if (ok.type != msgpack::type::BOOLEAN) detail::malformed("reply 'ok' must be a boolean");
    return ok.via.boolean;
}

}  // namespace

InferReply decode_infer_reply(const void* data, std::size_t size) {
    auto handle = detail::unpack(data, size, kMaxHeaderBytes);
    detail::Fields header(handle.get(), "reply");
    InferReply reply;
    reply.ok = read_ok(header);
    reply.id = detail::read_envelope(header, !reply.ok);
    if (!reply.ok) {
        reply.error = detail::read_error(header);
        return reply;
    }
    header.only({"v", "id", "ok", "model", "runtime", "fallback", "latency_us", "queue_us", "late",
                 "outputs", "thermal"});
    reply.model = header.string("model");
    reply.runtime = header.string("runtime");
    if (reply.runtime != "tensorrt" && reply.runtime != "onnx_trt_ep") {
        detail::malformed("reply.runtime must be tensorrt or onnx_trt_ep");
    }
    reply.fallback = header.boolean("fallback");
    reply.latency_us = header.uint("latency_us");
    reply.queue_us = header.uint("queue_us");
    reply.late = header.boolean("late");
    reply.thermal = detail::read_thermal_summary(header.string("thermal"), "reply.thermal");
    const auto& outputs = header.required("outputs");
    if (outputs.type != msgpack::type::ARRAY) detail::malformed("reply has no 'outputs' list");
    for (std::uint32_t i = 0; i < outputs.via.array.size; ++i) {
        reply.outputs.push_back(detail::read_descriptor(i, outputs.via.array.ptr[i]));
    }
    // Outputs are found by name (decode_outputs, InferResult::output): of two of one
    // name, one would be hidden, or both written into one buffer. Sorted (a model's
    // outputs may be a few hundred), not compared pair by pair.
    if (reply.outputs.size() > 1) {
        std::vector<std::string_view> names;
        names.reserve(reply.outputs.size());
        for (const auto& descriptor : reply.outputs) names.emplace_back(descriptor.name);
        std::sort(names.begin(), names.end());
        auto twice = std::adjacent_find(names.begin(), names.end());
        if (twice != names.end()) {
            detail::malformed("output '" + std::string(*twice) + "' is listed twice in the reply");
        }
    }
    return reply;
}

std::vector<NamedTensor> decode_outputs(const InferReply& reply, const std::vector<FrameBytes>& frames,
                                        const std::vector<TensorDescriptor>& placed,
                                        const std::vector<NamedOutputBuffer>& into) {
    std::size_t framed = 0;
    for (const auto& descriptor : reply.outputs) framed += descriptor.region ? 0 : 1;
    if (framed != frames.size()) {
        detail::malformed("reply describes " + std::to_string(framed) +
                          " outputs in frames but carries " + std::to_string(frames.size()) +
                          " frames");
    }
    // A buffer for an output the reply does not have (a misspelt name) would be
    // left as it was, as if written: refused, before any buffer is written.
    for (const auto& buffer : into) {
        std::string names;
        bool known = false;
        for (const auto& descriptor : reply.outputs) {
            known = known || descriptor.name == buffer.name;
            names += (names.empty() ? "'" : ", '") + descriptor.name + "'";
        }
        if (!known) {
            throw ClientError("output '" + buffer.name + "' was given a buffer; the reply's outputs are " +
                              (names.empty() ? std::string("none") : names));
        }
    }
    auto buffer_of = [&into](const std::string& name) {
        const NamedOutputBuffer* buffer = nullptr;
        for (const auto& candidate : into) {
            if (candidate.name == name) buffer = &candidate;
        }
        return buffer;
    };
    // Every output is checked before any is written: a buffer is filled whole or
    // left as it was, and none is written past its end.
    std::size_t next_frame = 0;
    for (const auto& descriptor : reply.outputs) {
        const auto* buffer = buffer_of(descriptor.name);
        auto expected = tensor_bytes(descriptor.dtype, descriptor.shape);  // checked when decoded
        if (descriptor.region) {
            const TensorDescriptor* asked = nullptr;
            for (const auto& candidate : placed) {
                if (candidate.name == descriptor.name) asked = &candidate;
            }
            const auto& where = *descriptor.region;
            if (buffer == nullptr || asked == nullptr || !asked->region ||
                asked->region->region != where.region || asked->region->offset != where.offset ||
                asked->region->nbytes != where.nbytes) {
                detail::malformed("output '" + descriptor.name +
                                  "' was written where it was not asked");
            }
            if (asked->dtype != descriptor.dtype || asked->shape != descriptor.shape ||
                expected != where.nbytes) {
                detail::malformed("output '" + descriptor.name +
                                  "' was written with another dtype or shape than it was placed with");
            }
            continue;
        }
        const auto& frame = frames[next_frame++];
        if (frame.size != expected) {
            detail::malformed("tensor '" + descriptor.name + "': frame holds " +
                              std::to_string(frame.size) + " bytes but its shape needs " +
                              std::to_string(expected));
        }
        if (buffer == nullptr) continue;
        if (buffer->buffer.dtype != descriptor.dtype || buffer->buffer.shape != descriptor.shape) {
            throw ClientError("output '" + descriptor.name +
                              "' does not have the dtype and shape of the buffer given for it");
        }
        if (buffer->buffer.nbytes != expected) {
            throw ClientError("output '" + descriptor.name + "' needs " + std::to_string(expected) +
                              " bytes; the buffer given for it holds " +
                              std::to_string(buffer->buffer.nbytes));
        }
    }
    std::vector<NamedTensor> outputs;
    next_frame = 0;
    for (const auto& descriptor : reply.outputs) {
        const auto* buffer = buffer_of(descriptor.name);
        if (descriptor.region) {
            outputs.push_back({descriptor.name, TensorView{descriptor.dtype, descriptor.shape,
                                                           buffer->buffer.data, buffer->buffer.nbytes}});
            continue;
        }
        const auto& frame = frames[next_frame++];
        if (buffer == nullptr) {
            outputs.push_back(
                {descriptor.name, TensorView{descriptor.dtype, descriptor.shape, frame.data, frame.size}});
            continue;
        }
        if (frame.size > 0) std::memcpy(buffer->buffer.data, frame.data, frame.size);
        outputs.push_back({descriptor.name, TensorView{descriptor.dtype, descriptor.shape,
                                                       buffer->buffer.data, frame.size}});
    }
    return outputs;
}

ControlReply decode_control_reply(const void* data, std::size_t size) {
    auto handle = detail::unpack(data, size, kMaxHeaderBytes);
    detail::Fields header(handle.get(), "reply");
    ControlReply reply;
    reply.ok = read_ok(header);
    reply.id = detail::read_envelope(header, !reply.ok);
    if (!reply.ok) {
        reply.error = detail::read_error(header);
        return reply;
    }
    header.only({"v", "id", "ok", "result"});
    const auto& result = header.required("result");
    if (result.type != msgpack::type::MAP) detail::malformed("reply 'result' must be a map");
    msgpack::sbuffer buffer;
    msgpack::pack(buffer, result);
    reply.result_msgpack.assign(buffer.data(), buffer.size());
    return reply;
}

std::string_view thermal_summary_name(ThermalSummary thermal) {
    switch (thermal) {
        case ThermalSummary::Nominal: return "nominal";
        case ThermalSummary::Throttling: return "throttling";
        case ThermalSummary::Unknown: return "unknown";
    }
    return "unknown";
}

std::string msgpack_to_json(const void* data, std::size_t size) {
    auto handle = detail::unpack(data, size, std::numeric_limits<std::size_t>::max(), false);
    return detail::to_json(handle.get());
}

}  // namespace inferd::wire
