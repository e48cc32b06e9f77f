#pragma once
// Watching a run: TensorBoard event files and tensor histograms. (Plots, log/plot.hpp, need
// cairo and the difftrain::plot target; include that header on its own.)
#include "difftrain/log/crc32c.hpp"
#include "difftrain/log/event_file.hpp"
#include "difftrain/log/histogram.hpp"
#include "difftrain/log/protobuf_wire.hpp"
#include "difftrain/log/tfrecord.hpp"
