#include "common/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "common/error.h"

namespace kestrel {

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, ": not a regular file");
  }
  size_ = size_t(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      fail(path, ": mmap failed: ", std::strerror(err));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

void read_pages(const uint8_t* p, size_t n) {
  if (n == 0) return;
  const size_t page = size_t(::sysconf(_SC_PAGESIZE));
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p) / page * page;
  const size_t len = reinterpret_cast<uintptr_t>(p) + n - begin;
#ifdef MADV_POPULATE_READ
  // One call maps every page (Linux 5.14+); older kernels fall back to touching each page.
  if (::madvise(reinterpret_cast<void*>(begin), len, MADV_POPULATE_READ) == 0) return;
#endif
  ::madvise(reinterpret_cast<void*>(begin), len, MADV_WILLNEED);  // start the read-ahead
  volatile uint8_t sink = 0;
  for (size_t off = 0; off < n; off += page) sink = sink + p[off];
  sink = sink + p[n - 1];
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, ": cannot open");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_text_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) fail(path, ": cannot create: ", std::strerror(errno));
  out.write(text.data(), std::streamsize(text.size()));
  out.close();
  if (!out) fail(path, ": write failed");
}

}  // namespace kestrel
