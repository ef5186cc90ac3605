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
    COMMENT "Embedding migrations for ${target}"
    VERBATIM)
  target_sources(${target} PRIVATE ${out})
endfunction()

# gpuaas_test(<name> LABELS ... [UNIT_SUITES ...] SOURCES ... LIBS ... [INCLUDES ...]): one gtest
# binary per library/service. Each TEST()/TEST_F() becomes its own ctest case (its own process, so
# a crash names its case). Suites listed in UNIT_SUITES need no servers and are labelled `unit`;
# the others get LABELS (e.g. nats, pg). INCLUDES: private include folders (a service's own tests
# name its src/; every other target sees only the service's include/).
function(gpuaas_test name)
  cmake_parse_arguments(T "" "" "LABELS;UNIT_SUITES;SOURCES;LIBS;INCLUDES" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LIBS} gpuaas_testing GTest::gtest GTest::gmock
    GTest::gtest_main gpuaas_warnings)
  if(T_INCLUDES)
    target_include_directories(${name} PRIVATE ${T_INCLUDES})
  endif()
  gtest_add_tests(TARGET ${name} SOURCES ${T_SOURCES} TEST_LIST tests)
  # A GTEST_SKIP() is reported by ctest as skipped, never as passed (gtest prints the marker
  # only for a skipped test; each ctest test runs one gtest case).
  set_tests_properties(${tests} PROPERTIES SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
  foreach(t ${tests})
    string(REGEX REPLACE "\\..*" "" suite "${t}")
    if(suite IN_LIST T_UNIT_SUITES)
      set_tests_properties(${t} PROPERTIES LABELS "unit" TIMEOUT 300)
    else()
      set_tests_properties(${t} PROPERTIES LABELS "${T_LABELS}" TIMEOUT 300)
    endif()
  endforeach()
endfunction()
include(GoogleTest)
