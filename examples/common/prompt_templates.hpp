#pragma once
// diffusers' textual-inversion prompt templates ("{}" is the word): imagenet_templates_small
// ("object") and imagenet_style_templates_small ("style"), as its training scripts use them.

#include <string>
#include <vector>

namespace examples {

inline const std::vector<std::string>& textual_inversion_templates(bool style) {
  static const std::vector<std::string> object = {
      "a photo of a {}",           "a rendering of a {}",
      "a cropped photo of the {}", "the photo of a {}",
      "a photo of a clean {}",     "a photo of a dirty {}",
      "a dark photo of the {}",    "a photo of my {}",
      "a photo of the cool {}",    "a close-up photo of a {}",
      "a bright photo of the {}",  "a cropped photo of a {}",
      "a photo of the {}",         "a good photo of the {}",
      "a photo of one {}",         "a close-up photo of the {}",
      "a rendition of the {}",     "a photo of the clean {}",
      "a rendition of a {}",       "a photo of a nice {}",
      "a good photo of a {}",      "a photo of the nice {}",
      "a photo of the small {}",   "a photo of the weird {}",
      "a photo of the large {}",   "a photo of a cool {}",
      "a photo of a small {}"};
  static const std::vector<std::string> styles = {
      "a painting in the style of {}",         "a rendering in the style of {}",
      "a cropped painting in the style of {}", "the painting in the style of {}",
      "a clean painting in the style of {}",   "a dirty painting in the style of {}",
      "a dark painting in the style of {}",    "a picture in the style of {}",
      "a cool painting in the style of {}",    "a close-up painting in the style of {}",
      "a bright painting in the style of {}",  "a cropped painting in the style of {}",
      "a good painting in the style of {}",    "a close-up painting in the style of {}",
      "a rendition in the style of {}",        "a nice painting in the style of {}",
      "a small painting in the style of {}",   "a weird painting in the style of {}",
      "a large painting in the style of {}"};
  return style ? styles : object;
}

}  // namespace examples
