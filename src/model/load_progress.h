// Loading with progress. Weights are views into mapped files, so building them reads nothing; a
// large model's bytes would then be read from disk during the first forward pass (or the GPU
// upload) with no sign of life. With progress on, load_model reads every byte the views cover
// right away, layer by layer, and one stderr line rewritten in place says how far it is.
#pragma once
#include <cstddef>
#include <string>

namespace kestrel {

struct Model;

enum class Progress {
  Off,   // read nothing at load
  Auto,  // as On when stderr is a terminal, else Off
  On,
};

bool progress_shown(Progress p);

// Reads the weights of `m` layer by layer (embedding, layers, LM head), printing
// "loading LABEL: layer i/N, X/Y MB" in place and a last line with the time taken. Returns the
// bytes read.
size_t read_weights_with_progress(const Model& m, const std::string& label);

}  // namespace kestrel
