#include "util/files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <random>
#include <system_error>

#include "util/error.h"

namespace lorasync {

namespace {

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }

 private:
  int fd_;
};

void write_all(int fd, std::string_view data, const fs::path& path) {
  const char* p = data.data();
  std::size_t left = data.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_env("cannot write {}: {}", path.string(), errno_text());
    }
    p += n;
    left -= static_cast<std::size_t>(n);
  }
}

}  // namespace

std::string read_file(const fs::path& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) throw_not_found("file not found: {}", path.string());
    throw_env("cannot open {}: {}", path.string(), errno_text());
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw_env("cannot stat {}: {}", path.string(), errno_text());
  if (S_ISDIR(st.st_mode)) throw_invalid("{} is a directory, expected a file", path.string());
  std::string out;
  out.resize(static_cast<std::size_t>(st.st_size));
  std::size_t got = 0;
  while (got < out.size()) {
    ssize_t n = ::read(fd.get(), out.data() + got, out.size() - got);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_env("cannot read {}: {}", path.string(), errno_text());
    }
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  out.resize(got);
  // Files that grow while read (or report size 0, like /proc): read the rest.
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  return out;
}

void fsync_path(const fs::path& path, bool is_directory) {
  Fd fd(::open(path.c_str(), (is_directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC));
  if (fd.get() < 0) throw_env("cannot open {} for fsync: {}", path.string(), errno_text());
  if (::fsync(fd.get()) != 0 && errno != EINVAL)
    throw_env("fsync of {} failed: {}", path.string(), errno_text());
}

void write_file_durable(const fs::path& path, std::string_view data) {
  Fd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) throw_env("cannot create {}: {}", path.string(), errno_text());
  write_all(fd.get(), data, path);
  if (::fsync(fd.get()) != 0) throw_env("fsync of {} failed: {}", path.string(), errno_text());
  if (::close(fd.release()) != 0) throw_env("close of {} failed: {}", path.string(), errno_text());
}

void write_file_atomic(const fs::path& path, std::string_view data) {
  fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  fs::path tmp = dir / fmt::format(".{}.tmp-{}", path.filename().string(), random_hex(6));
  try {
    write_file_durable(tmp, data);
    if (::rename(tmp.c_str(), path.c_str()) != 0)
      throw_env("cannot rename {} to {}: {}", tmp.string(), path.string(), errno_text());
  } catch (...) {
    std::error_code ec;
    fs::remove(tmp, ec);
    throw;
  }
  fsync_path(dir, true);
}

void rename_and_sync(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    throw_env("cannot rename {} to {}: {}", from.string(), to.string(), errno_text());
  fsync_path(to.has_parent_path() ? to.parent_path() : fs::path("."), true);
}

void random_hex(std::size_t n_bytes, char* out) {
  static thread_local std::mt19937_64 gen{std::random_device{}()};
  static constexpr char kHex[] = "0123456789abcdef";
  std::uint64_t bits = 0;
  for (std::size_t i = 0; i < n_bytes; ++i) {
    if (i % 8 == 0) bits = gen();  // eight bytes per draw
    auto b = static_cast<unsigned>(bits & 0xff);
    bits >>= 8;
    *out++ = kHex[b >> 4];
    *out++ = kHex[b & 15];
  }
}

std::string random_hex(std::size_t n_bytes) {
  std::string out(2 * n_bytes, '\0');
  random_hex(n_bytes, out.data());
  return out;
}

MappedFile::MappedFile(const fs::path& path) : path_(path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    if (errno == ENOENT) throw_not_found("file not found: {}", path.string());
    throw_env("cannot open {}: {}", path.string(), errno_text());
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) throw_env("cannot stat {}: {}", path.string(), errno_text());
  if (!S_ISREG(st.st_mode)) throw_invalid("{} is not a regular file", path.string());
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ == 0) return;
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (p == MAP_FAILED) throw_env("cannot mmap {} ({} bytes): {}", path.string(), size_, errno_text());
  data_ = static_cast<const std::uint8_t*>(p);
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<std::uint8_t*>(data_), size_);
}

TempDir::TempDir(std::string_view prefix) {
  fs::path base = fs::temp_directory_path();
  std::string tmpl = (base / fmt::format("{}-XXXXXX", prefix)).string();
  if (::mkdtemp(tmpl.data()) == nullptr) throw_env("mkdtemp {} failed: {}", tmpl, errno_text());
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  fs::remove_all(path_, ec);
}

}  // namespace lorasync
