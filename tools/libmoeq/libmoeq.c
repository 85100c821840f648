/* libmoeq.so is the static library linked whole (CMakeLists.txt); this file only gives the
 * shared target a source and the loader a cheap symbol to check the build it opened. */
#include "moeq.h"

int moeq_abi_version(void) { return 1; }
