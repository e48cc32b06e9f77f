#pragma once
// Text conditioning: tokenizers read from transformers' tokenizer folders (link difftrain::text,
// which brings ICU).

#include "difftrain/text/clip_tokenizer.hpp"
#include "difftrain/text/encode_prompt.hpp"
#include "difftrain/text/t5_tokenizer.hpp"
#include "difftrain/text/textual_inversion.hpp"
#include "difftrain/text/unicode.hpp"
#include "difftrain/text/webui_conditioning.hpp"
#include "difftrain/text/webui_prompt.hpp"
