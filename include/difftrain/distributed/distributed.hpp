#pragma once
// Umbrella header of the distributed layer. The process groups need Gloo's headers (Debian:
// libgloo-dev); without them this header offers the sampler alone.

#include "difftrain/distributed/sampler.hpp"
#if __has_include(<gloo/rendezvous/store.h>)
#include "difftrain/distributed/data_parallel.hpp"
#include "difftrain/distributed/sharded_data_parallel.hpp"
#include "difftrain/distributed/world.hpp"
#endif
