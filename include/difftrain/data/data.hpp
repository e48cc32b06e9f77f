#pragma once
// Data: image files as PIL opens them, captioned image folders, torchvision's transforms, kohya's
// aspect-ratio buckets and the ordered parallel loader (link difftrain::data, which brings
// libjpeg-turbo and libwebp).

#include "difftrain/data/buckets.hpp"
#include "difftrain/data/image.hpp"
#include "difftrain/data/image_folder.hpp"
#include "difftrain/data/latent_cache.hpp"
#include "difftrain/data/loader.hpp"
#include "difftrain/data/tensor_cache.hpp"
#include "difftrain/data/transforms.hpp"
#if defined(DIFFTRAIN_HAS_VIDEO)
#include "difftrain/data/video_file.hpp"
#endif
