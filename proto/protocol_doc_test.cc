// docs/protocol.md lists every message of proto/baton/v1/ with every field
// (number, name, type) and its reserved numbers; this test fails when the
// document and the proto differ, so neither can change alone.
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "baton/v1/coordinator.pb.h"
#include "baton/v1/job.pb.h"
#include "baton/v1/plan.pb.h"
#include "baton/v1/program.pb.h"
#include "gtest/gtest.h"

namespace baton {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;

struct Documented {
  std::map<int, std::string> fields;  // number -> "name type"
  std::set<int> reserved;
};

std::string TypeText(const FieldDescriptor& f) {
  std::string t;
  if (f.is_repeated()) t = "repeated ";
  if (f.has_optional_keyword()) t = "optional ";
  if (f.message_type() != nullptr) {
    absl::StrAppend(&t, f.message_type()->name());
  } else if (f.enum_type() != nullptr) {
    absl::StrAppend(&t, f.enum_type()->name());
  } else {
    absl::StrAppend(&t, f.type_name());
  }
  if (f.real_containing_oneof() != nullptr) absl::StrAppend(&t, " (oneof `", f.real_containing_oneof()->name(), "`)");
  return t;
}

void Collect(const Descriptor& d, const std::string& prefix, std::map<std::string, Documented>* out) {
  Documented& doc = (*out)[prefix + d.name()];
  for (int i = 0; i < d.field_count(); ++i) {
    const FieldDescriptor& f = *d.field(i);
    doc.fields[f.number()] = absl::StrCat(f.name(), " ", TypeText(f));
  }
  for (int i = 0; i < d.reserved_range_count(); ++i) {
    for (int n = d.reserved_range(i)->start; n < d.reserved_range(i)->end; ++n) doc.reserved.insert(n);
  }
  for (int i = 0; i < d.nested_type_count(); ++i) Collect(*d.nested_type(i), prefix + d.name() + ".", out);
}

std::map<std::string, Documented> FromProto() {
  std::map<std::string, Documented> out;
  for (const google::protobuf::FileDescriptor* file :
       {v1::RegisterRequest::descriptor()->file(), v1::JobSpec::descriptor()->file(),
        v1::Plan::descriptor()->file(), v1::Program::descriptor()->file()}) {
    for (int i = 0; i < file->message_type_count(); ++i) Collect(*file->message_type(i), "", &out);
  }
  return out;
}

std::map<std::string, Documented> FromDoc(const std::string& text) {
  std::map<std::string, Documented> out;
  const size_t start = text.find("\n## Messages\n");
  EXPECT_NE(start, std::string::npos) << "docs/protocol.md has no '## Messages' section";
  if (start == std::string::npos) return out;
  const std::regex header(R"(^#### `([\w.]+)`$)");
  const std::regex row(R"(^\| (\d+) \| `(\w+)` \| ([^|]+?) \|.*$)");
  const std::regex reserved(R"(^Reserved: ([\d, ]+) \(.*$)");
  Documented* current = nullptr;
  std::istringstream lines(text.substr(start));
  std::string line;
  std::smatch m;
  while (std::getline(lines, line)) {
    if (std::regex_match(line, m, header)) {
      EXPECT_EQ(out.count(m[1]), 0u) << "message " << m[1] << " is documented twice";
      current = &out[m[1]];
    } else if (current != nullptr && std::regex_match(line, m, row)) {
      const int number = std::stoi(m[1]);
      EXPECT_EQ(current->fields.count(number), 0u) << line;
      current->fields[number] = absl::StrCat(m[2].str(), " ", m[3].str());
    } else if (current != nullptr && std::regex_match(line, m, reserved)) {
      for (absl::string_view n : absl::StrSplit(m[1].str(), ',', absl::SkipWhitespace())) {
        current->reserved.insert(std::stoi(std::string(absl::StripAsciiWhitespace(n))));
      }
    }
  }
  return out;
}

TEST(ProtocolDocTest, EveryMessageAndFieldOfTheProtoIsDocumentedAsItIs) {
  std::ifstream in("docs/protocol.md");
  ASSERT_TRUE(in.good()) << "docs/protocol.md is not in the runfiles";
  std::stringstream text;
  text << in.rdbuf();
  const std::map<std::string, Documented> proto = FromProto();
  const std::map<std::string, Documented> doc = FromDoc(text.str());
  ASSERT_GT(proto.size(), 40u);
  for (const auto& [name, want] : proto) {
    auto it = doc.find(name);
    if (it == doc.end()) {
      ADD_FAILURE() << "docs/protocol.md does not document message " << name;
      continue;
    }
    for (const auto& [number, field] : want.fields) {
      auto f = it->second.fields.find(number);
      EXPECT_TRUE(f != it->second.fields.end() && f->second == field)
          << name << " field " << number << ": proto has '" << field << "', the document '"
          << (f == it->second.fields.end() ? "(nothing)" : f->second) << "'";
    }
    for (const auto& [number, field] : it->second.fields) {
      EXPECT_EQ(want.fields.count(number), 1u) << name << ": the document lists field " << number << " '" << field
                                               << "', which the proto does not have";
    }
    EXPECT_EQ(absl::StrJoin(it->second.reserved, ","), absl::StrJoin(want.reserved, ","))
        << name << ": reserved numbers differ (document vs proto)";
  }
  for (const auto& [name, unused] : doc) {
    EXPECT_EQ(proto.count(name), 1u) << "docs/protocol.md documents " << name << ", which the proto does not have";
  }
}

}  // namespace
}  // namespace baton
