#pragma once
// Umbrella header of the models layer: diffusers' UNet2DConditionModel, AutoencoderKL,
// DiTTransformer2DModel, PixArtTransformer2DModel, SD3Transformer2DModel and
// CogVideoXTransformer3DModel, their building blocks, transformers' CLIP and T5 text encoders, and
// model folders.

#include "difftrain/models/autoencoder_kl.hpp"
#include "difftrain/models/autoencoder_kl_cogvideox.hpp"
#include "difftrain/models/clip_text_model.hpp"
#include "difftrain/models/cogvideox_transformer_3d.hpp"
#include "difftrain/models/config_reader.hpp"
#include "difftrain/models/dit_transformer_2d.hpp"
#include "difftrain/models/embeddings.hpp"
#include "difftrain/models/feed_forward.hpp"
#include "difftrain/models/flux_transformer_2d.hpp"
#include "difftrain/models/patch_embed.hpp"
#include "difftrain/models/pixart_transformer_2d.hpp"
#include "difftrain/models/pretrained.hpp"
#include "difftrain/models/resnet.hpp"
#include "difftrain/models/sd3_transformer_2d.hpp"
#include "difftrain/models/t5_encoder.hpp"
#include "difftrain/models/transformer_2d.hpp"
#include "difftrain/models/transformers_config.hpp"
#include "difftrain/models/unet_2d_condition.hpp"
#include "difftrain/models/unet_blocks.hpp"
