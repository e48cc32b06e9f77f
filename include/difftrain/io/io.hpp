#pragma once
// Umbrella header of the io layer.

#include "difftrain/io/atomic_file.hpp"
#include "difftrain/io/csv_log.hpp"
#include "difftrain/io/embedded_data.hpp"
#include "difftrain/io/idx.hpp"
#include "difftrain/io/image_grid.hpp"
#include "difftrain/io/inflate.hpp"
#include "difftrain/io/json_file.hpp"
#include "difftrain/io/png.hpp"
#include "difftrain/io/read_file.hpp"
#include "difftrain/io/remove_tree.hpp"
#include "difftrain/io/safetensors.hpp"
#include "difftrain/io/torch_file.hpp"
#include "difftrain/io/torch_pickle.hpp"
