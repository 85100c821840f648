# Cross build for 64-bit Arm Linux with Debian's gcc-aarch64-linux-gnu and the :arm64 -dev
# packages (dpkg --add-architecture arm64); ctest runs the binaries under qemu-aarch64.
#   cmake -S . -B build-arm64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
# the arm64 packages' .pc files, not the build machine's
set(ENV{PKG_CONFIG_LIBDIR} /usr/lib/aarch64-linux-gnu/pkgconfig:/usr/share/pkgconfig)
set(ENV{PKG_CONFIG_SYSROOT_DIR} /)
# The binaries run with the :arm64 (multiarch) glibc and loader under /, not the cross toolchain's
# copy in /usr/aarch64-linux-gnu: under qemu-aarch64 7.2 that copy (libc6-arm64-cross
# 2.36-8cross1) spins forever in pthread_create, so every threaded test hung.
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64;-L;/)
