/* Callgrind's client requests, callable from Python with ctypes (bench_instructions.py).
 *
 * Under valgrind --tool=callgrind --instr-atstart=no, a process calls cg_measure_start()
 * when the code to count begins and cg_measure_dump() when it ends: only the instructions
 * in between are in the dump.  Outside valgrind each request is a few no-op instructions.
 */
#include <valgrind/callgrind.h>

void cg_measure_start(void) {
    CALLGRIND_START_INSTRUMENTATION;
    CALLGRIND_ZERO_STATS;
}

void cg_measure_dump(void) {
    CALLGRIND_DUMP_STATS_AT("measured");
    CALLGRIND_STOP_INSTRUMENTATION;
}
