# Script mode: writes a C++ file listing migrations {version, name, sql}.
set(body "// Generated from SQL migrations. Do not edit.\n#include \"gpuaas/common/store.hpp\"\nnamespace ${NS} {\nconst std::vector<gpuaas::store::Migration>& Migrations() {\n  static const std::vector<gpuaas::store::Migration> kMigrations = {\n")
foreach(f ${FILES})
  get_filename_component(name ${f} NAME)
  string(REGEX MATCH "^[0-9]+" version ${name})
  # "0008" is the number 8 (a leading 0 would make it an octal literal in C++).
  math(EXPR version "${version}" OUTPUT_FORMAT DECIMAL)
  file(READ ${f} sql)
  string(APPEND body "    {${version}, \"${name}\", R\"__sql__(${sql})__sql__\"},\n")
endforeach()
string(APPEND body "  };\n  return kMigrations;\n}\n}  // namespace ${NS}\n")
file(WRITE ${OUT}.tmp "${body}")
file(COPY_FILE ${OUT}.tmp ${OUT} ONLY_IF_DIFFERENT)
