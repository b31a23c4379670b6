// A minimal test harness: CHECK records a failure and goes on; a test program
// exits non-zero when any check failed.
#pragma once

#include <functional>
#include <iostream>
#include <string>
#include <vector>

namespace inferd::testing {

inline int& failures() {
    static int count = 0;
    return count;
}

inline void fail(const char* file, int line, const std::string& what) {
    ++failures();
    std::cerr << file << ":" << line << ": FAILED: " << what << "\n";
}

struct Case {
    std::string name;
    std::function<void()> body;
    bool on_demand = false;  // runs only when named on the command line
};

inline std::vector<Case>& cases() {
    static std::vector<Case> all;
    return all;
}

struct Register {
    Register(const char* name, std::function<void()> body, bool on_demand = false) {
        cases().push_back({name, std::move(body), on_demand});
    }
};

// Runs every case but the on-demand ones, or those named on the command line; an
// exception fails its case.
inline int run_all(int argc, char** argv) {
    for (const auto& test : cases()) {
        bool chosen = argc < 2 && !test.on_demand;
        for (int i = 1; i < argc; ++i) chosen = chosen || test.name == argv[i];
        if (!chosen) continue;
        int before = failures();
        try {
            test.body();
        } catch (const std::exception& error) {
            fail(test.name.c_str(), 0, std::string("uncaught exception: ") + error.what());
        }
        std::cout << (failures() == before ? "ok     " : "FAILED ") << test.name << std::endl;
    }
    std::cout << (failures() ? "FAILED" : "passed") << " (" << failures() << " failed checks)\n";
    return failures() ? 1 : 0;
}

}  // namespace inferd::testing

#define INFERD_CONCAT2(a, b) a##b
#define INFERD_CONCAT(a, b) INFERD_CONCAT2(a, b)
#define TEST(name)                                                                        \
    static void name();                                                                   \
    static const ::inferd::testing::Register INFERD_CONCAT(register_, name)(#name, name); \
    static void name()
// A case that needs what only some runs set up (the driver names it).
#define TEST_ON_DEMAND(name)                                                                    \
    static void name();                                                                         \
    static const ::inferd::testing::Register INFERD_CONCAT(register_, name)(#name, name, true); \
    static void name()
#define CHECK(condition)                                                                     \
    do {                                                                                     \
        if (!(condition)) ::inferd::testing::fail(__FILE__, __LINE__, #condition);           \
    } while (0)
#define CHECK_EQ(a, b)                                                                       \
    do {                                                                                     \
        if (!((a) == (b)))                                                                   \
            ::inferd::testing::fail(__FILE__, __LINE__, std::string(#a " == " #b));          \
    } while (0)
// `statement` throws `type` (and `then` holds for the caught `error`).
#define CHECK_THROWS(type, statement, then)                                                  \
    do {                                                                                     \
        bool thrown = false;                                                                 \
        try {                                                                                \
            statement;                                                                       \
        } catch (const type& error) {                                                        \
            thrown = true;                                                                   \
            (void)error;                                                                     \
            if (!(then)) ::inferd::testing::fail(__FILE__, __LINE__, "after " #type ": " #then); \
        }                                                                                    \
        if (!thrown) ::inferd::testing::fail(__FILE__, __LINE__, #statement " did not throw " #type); \
    } while (0)
