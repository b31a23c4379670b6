// The inferd C++ client: one include for everything.
#pragma once

#include "inferd/client.hpp"
#include "inferd/endpoints.hpp"
#include "inferd/errors.hpp"
#include "inferd/events.hpp"
#include "inferd/poll_window.hpp"
#include "inferd/region.hpp"
#include "inferd/tensor.hpp"
#include "inferd/wire.hpp"
