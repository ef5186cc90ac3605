# gpuaas_embed_sql(<target> <dir>): compiles every <dir>/*.sql (sorted by name) into the
# target as gpuaas::store::Migration entries, so binaries carry their own schema.
function(gpuaas_embed_sql target namespace dir)
  file(GLOB sql_files CONFIGURE_DEPENDS ${dir}/*.sql)
  list(SORT sql_files)
  set(out ${CMAKE_CURRENT_BINARY_DIR}/${target}_migrations.cpp)
  add_custom_command(
    OUTPUT ${out}
    COMMAND ${CMAKE_COMMAND} -DOUT=${out} -DNS=${namespace} "-DFILES=${sql_files}"
            -P ${PROJECT_SOURCE_DIR}/cmake/EmbedSql.cmake
    DEPENDS ${sql_files} ${PROJECT_SOURCE_DIR}/cmake/EmbedSql.cmake
    COMMENT "Embedding migrations for ${target}")
  target_sources(${target} PRIVATE ${out})
endfunction()

# gpuaas_test(<name> LABELS ... SOURCES ... LIBS ...): one gtest binary per library/service.
function(gpuaas_test name)
  cmake_parse_arguments(T "" "" "LABELS;SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LIBS} gpuaas_testing GTest::gtest GTest::gmock GTest::gtest_main gpuaas_warnings)
  # Each test case runs in its own process (gtest_discover_tests) so a crash names its case.
  gtest_discover_tests(${name} DISCOVERY_TIMEOUT 60 PROPERTIES LABELS "${T_LABELS}" TIMEOUT 300)
endfunction()
include(GoogleTest)
