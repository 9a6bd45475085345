// The Communicator of the CPU backend: the ranks are threads of one process and the buffers are
// host memory. Every rank sums all ranks' buffers itself, in rank order, so every rank gets the
// same bits.
#pragma once
#include <memory>
#include <vector>

#include "parallel/communicator.h"

namespace kestrel {

// One communicator per rank of a group of `ranks` threads; rank r's must only be used by one thread.
std::vector<std::unique_ptr<Communicator>> make_thread_communicators(int ranks);

}  // namespace kestrel
