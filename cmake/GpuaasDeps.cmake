# All dependencies come from Debian packages (scripts/install-deps).
find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)
find_package(Protobuf REQUIRED)
find_package(GTest REQUIRED)
find_package(yaml-cpp REQUIRED)
find_package(nlohmann_json REQUIRED)
find_package(fmt REQUIRED)
find_package(CLI11 REQUIRED)
find_package(prometheus-cpp CONFIG REQUIRED)
find_package(Boost 1.74 REQUIRED)
find_package(OpenSSL REQUIRED)
# nats.c's CMake config is broken on Debian; its pkg-config file works.
pkg_check_modules(NATS REQUIRED IMPORTED_TARGET libnats)
pkg_check_modules(PQXX REQUIRED IMPORTED_TARGET libpqxx)
pkg_check_modules(LIBVIRT REQUIRED IMPORTED_TARGET libvirt)
# The node-agent's image fetch (file://, http://, https://; resumable).
pkg_check_modules(CURL REQUIRED IMPORTED_TARGET libcurl)
# tests/chaos/net_delay.cpp (the chaos campaign's latency fault)
pkg_check_modules(NFQUEUE REQUIRED IMPORTED_TARGET libnetfilter_queue)
# Request tokens (gpuaas::auth): JWT ES256.
pkg_check_modules(JWT REQUIRED IMPORTED_TARGET libjwt)
