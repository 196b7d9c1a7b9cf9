// main() for fuzz targets outside --config=fuzz: feeds each file named on the
// command line to LLVMFuzzerTestOneInput once (the seed corpus as a test).
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  int inputs = 0;
  for (int i = 1; i < argc; ++i) {
    std::ifstream in(argv[i], std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "fuzz replay: cannot read %s\n", argv[i]);
      return 1;
    }
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    ++inputs;
  }
  if (inputs == 0) {
    std::fprintf(stderr, "fuzz replay: no corpus files given\n");
    return 1;
  }
  std::printf("fuzz replay: %d inputs ran without a crash\n", inputs);
  return 0;
}
