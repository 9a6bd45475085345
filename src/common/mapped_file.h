// A read-only memory-mapped file. Checkpoints are mapped, never copied, so loading a model costs
// page faults instead of reads and the weights are shared with the page cache.
#pragma once
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace kestrel {

class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const uint8_t> bytes() const { return {data_, size_}; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Brings the pages of [p, p + n), a range of a mapped file, into memory (reads them from disk if
// they are not in the page cache yet), so that later accesses do not fault.
void read_pages(const uint8_t* p, size_t n);

// Reads a whole (small) text file; errors name the path.
std::string read_text_file(const std::string& path);

// Creates or replaces a (small) file with `text`; errors name the path.
void write_text_file(const std::string& path, const std::string& text);

}  // namespace kestrel
