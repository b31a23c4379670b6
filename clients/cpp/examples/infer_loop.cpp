// A flight-software style loop: connect, infer at a fixed rate with a deadline
// of one period, and print latency percentiles and the thermal state.
//
//   inferd_infer_loop [--model demo] [--rate-hz 20] [--count 200] [--endpoint ipc://...]
//                     [--events ipc://...]
//
// Endpoints default as the Python client's ($INFERD_RUNTIME_DIR,
// $XDG_RUNTIME_DIR/inferd, ...). The input is zeros of the model's input
// shapes (as describe reports them; a dynamic dimension is 1): replace it with
// your sensor data.
#include <inferd/inferd.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Arguments {
    std::string model = "demo";
    double rate_hz = 20;
    int count = 200;
    std::string endpoint;  // empty: the default
    std::string events;
};

constexpr const char* kUsage =
    "usage: inferd_infer_loop [--model demo] [--rate-hz 20] [--count 200] [--endpoint ipc://...] "
    "[--events ipc://...]\n";

Arguments parse(int argc, char** argv) {
    Arguments arguments;
    for (int i = 1; i < argc; i += 2) {
        if (std::string(argv[i]) == "--help") {
            std::cout << kUsage;
            std::exit(0);
        }
        if (i + 1 >= argc) throw std::invalid_argument(std::string(argv[i]) + " needs a value");
        std::string flag = argv[i], value = argv[i + 1];
        if (flag == "--model") arguments.model = value;
        else if (flag == "--rate-hz") arguments.rate_hz = std::stod(value);
        else if (flag == "--count") arguments.count = std::stoi(value);
        else if (flag == "--endpoint") arguments.endpoint = value;
        else if (flag == "--events") arguments.events = value;
        else throw std::invalid_argument("unknown option " + flag);
    }
    // The period is the deadline: at most an hour (the wire's longest). A rate of
    // 0 or NaN made it infinite, and converting that to clock ticks is undefined.
    if (!(arguments.rate_hz >= 1.0 / 3600) || !std::isfinite(arguments.rate_hz)) {
        throw std::invalid_argument("--rate-hz must be a positive number, at least 1/3600 "
                                    "(one request an hour: the longest deadline)");
    }
    return arguments;
}

double percentile(std::vector<double> values, double q) {
    if (values.empty()) return 0;
    std::sort(values.begin(), values.end());
    auto index = static_cast<std::size_t>(q * static_cast<double>(values.size() - 1) + 0.5);
    return values[std::min(index, values.size() - 1)];
}

}  // namespace

int main(int argc, char** argv) try {
    auto arguments = parse(argc, argv);
    inferd::ClientOptions options;
    options.endpoint = arguments.endpoint;
    options.timeout = std::chrono::milliseconds(1000);
    inferd::InferenceClient client(options);

    // Buffers for the model's inputs, allocated once and reused every cycle.
    std::vector<std::vector<unsigned char>> buffers;
    std::vector<inferd::NamedTensor> inputs;
    for (const auto& model : client.describe()) {
        if (model.name != arguments.model) continue;
        for (const auto& spec : model.inputs) {
            inferd::Shape shape;
            for (const auto& dimension : spec.shape) shape.push_back(dimension.value_or(1));
            buffers.emplace_back(inferd::tensor_bytes(spec.dtype, shape));
            inputs.push_back({spec.name, inferd::TensorView{spec.dtype, shape, buffers.back().data(),
                                                            buffers.back().size()}});
        }
    }
    if (inputs.empty()) {
        std::cerr << "the daemon serves no model named " << arguments.model << "\n";
        return 2;
    }

    inferd::SubscriberOptions subscription;
    subscription.endpoint = arguments.events;
    subscription.topics = {"thermal"};
    inferd::EventSubscriber thermal_events(subscription);
    // ZeroMQ delivers nothing published before the subscription arrived: wait
    // for it (the daemon's first health event) before the loop starts.
    thermal_events.wait_joined(std::chrono::seconds(5));
    std::optional<inferd::ThermalEvent> last_thermal;

    const auto period = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
        std::chrono::duration<double>(1.0 / arguments.rate_hz));
    inferd::InferOptions infer;
    infer.deadline_ms = static_cast<std::uint32_t>(std::max<long long>(
        1, std::chrono::duration_cast<std::chrono::milliseconds>(period).count()));

    std::vector<double> latencies_ms;
    int late = 0, errors = 0, timeouts = 0;
    std::string thermal = "unknown";
    auto next = std::chrono::steady_clock::now();
    for (int i = 0; i < arguments.count; ++i) {
        auto started = std::chrono::steady_clock::now();
        try {
            auto result = client.infer(arguments.model, inputs, infer);
            latencies_ms.push_back(
                std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - started).count());
            late += result.reply.late ? 1 : 0;
            thermal = std::string(inferd::wire::thermal_summary_name(result.reply.thermal));
        } catch (const inferd::RemoteError& error) {
            ++errors;  // e.g. DEADLINE_EXCEEDED: this cycle's result is dropped
            std::cerr << "cycle " << i << ": " << error.what() << "\n";
        } catch (const inferd::Timeout& error) {
            ++timeouts;
            std::cerr << "cycle " << i << ": " << error.what() << "\n";
        }
        // Thermal events that came in meanwhile, without waiting for one.
        while (auto event = thermal_events.receive(std::chrono::milliseconds(0))) {
            last_thermal = std::get<inferd::ThermalEvent>(*event);
        }
        next += period;
        std::this_thread::sleep_until(next);  // the loop's fixed rate
    }

    if (!last_thermal) {  // a loop shorter than the thermal poll period
        if (auto event = thermal_events.receive(std::chrono::seconds(2))) {
            last_thermal = std::get<inferd::ThermalEvent>(*event);
        }
    }

    std::printf("%s: %zu ok, %d late, %d errors, %d timeouts at %.1f Hz\n", arguments.model.c_str(),
                latencies_ms.size(), late, errors, timeouts, arguments.rate_hz);
    std::printf("round trip ms: p50 %.3f  p90 %.3f  p99 %.3f  max %.3f\n",
                percentile(latencies_ms, 0.5), percentile(latencies_ms, 0.9),
                percentile(latencies_ms, 0.99), percentile(latencies_ms, 1.0));
    std::printf("thermal: %s", thermal.c_str());
    if (last_thermal && last_thermal->available) {
        std::printf(" (throttling %s, cpu %.1f C)", last_thermal->throttle_active ? "yes" : "no",
                    last_thermal->cpu_temp_c.value_or(0.0));
    } else if (last_thermal) {
        std::printf(" (no telemetry on this machine)");
    }
    std::printf("\n");
    return errors + timeouts == 0 ? 0 : 1;
} catch (const std::exception& error) {
    std::cerr << "inferd_infer_loop: " << error.what() << "\n";
    return 1;
}
