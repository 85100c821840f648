#!/usr/bin/env bash
# OpenBLAS's kernel set: --version names it; where OpenBLAS runs a set without AVX2 on a CPU with
# AVX2 and FMA (its Prescott fallback for Intel models it does not know), the CLI runs again with
# OPENBLAS_CORETYPE set to the one that suits the CPU, and that run is the whole command: its
# checkpoint is byte for byte the one of a run started with the variable set. A set
# OPENBLAS_CORETYPE is kept. MOEQ_BLAS_PRETEND_CORE makes the library judge another set than the
# one OpenBLAS chose (OpenBLAS knows this machine's CPU).
. "$(dirname "$0")/common.sh"
native_only "OpenBLAS picks its kernels by the host CPU"
# OpenBLAS's own choice (MOEQ_BLAS_REEXEC set: no re-run, as after one)
v=$(env -u OPENBLAS_CORETYPE MOEQ_BLAS_REEXEC=none "$cli" --version) || fail "--version exited $?"
grep -qE "^BLAS: OpenBLAS [A-Za-z0-9_]+$" <<< "$v" || fail "no BLAS line: $v"
case "$(grep '^CPU kernels:' <<< "$v")" in
    *avx512*) want=SkylakeX ;;
    *avx2*) want=Haswell ;;
    *) echo "SKIP: the CPU has no AVX2: nothing better than OpenBLAS's own choice"; exit 77 ;;
esac
case "$(grep '^CPU kernels:' <<< "$v")" in *"avx512 off"*) want=Haswell ;; esac
pretend() { env -u OPENBLAS_CORETYPE -u MOEQ_BLAS_REEXEC MOEQ_BLAS_PRETEND_CORE=Prescott "$cli" "$@"; }

pretend --version > "$tmp/v" || fail "--version with the Prescott set exited $?"
grep -qx "BLAS: OpenBLAS $want (OPENBLAS_CORETYPE=$want set by moeq: OpenBLAS chose .*)" "$tmp/v" ||
    fail "not run again with $want: $(cat "$tmp/v")"
# the user's choice stays
OPENBLAS_CORETYPE=Prescott MOEQ_BLAS_PRETEND_CORE=Prescott "$cli" --version | grep -qx "BLAS: OpenBLAS Prescott" ||
    fail "a set OPENBLAS_CORETYPE=Prescott was not kept"
# a whole command in the new process, with its arguments and exit status
q=(quantize "$model" --scheme nvfp4a16 --method gptq --calib "$repo/data/demo-calib.txt" --nsamples 4 --seqlen 32
   --threads 2 --quiet)
pretend "${q[@]}" --out "$tmp/a" > /dev/null 2> "$tmp/a.err" || fail "quantize with the Prescott set exited $?: $(cat "$tmp/a.err")"
env -u MOEQ_BLAS_REEXEC OPENBLAS_CORETYPE=$want "$cli" "${q[@]}" --out "$tmp/b" > /dev/null 2> "$tmp/b.err" ||
    fail "quantize with OPENBLAS_CORETYPE=$want exited $?: $(cat "$tmp/b.err")"
same_checkpoint "$tmp/b" "$tmp/a" "the re-run's checkpoint" "OPENBLAS_CORETYPE=$want's"
# under mpirun every rank runs again before joining the job (MPI starts after)
if grep -q "^MPI: Open MPI" <<< "$v" && command -v mpirun > /dev/null; then
    # as test_mpi.sh: root in containers, localhost only
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_plm_rsh_agent=false
    env -u OPENBLAS_CORETYPE -u MOEQ_BLAS_REEXEC MOEQ_BLAS_PRETEND_CORE=Prescott timeout 300 mpirun --oversubscribe \
        -x MOEQ_BLAS_PRETEND_CORE -np 2 "$cli" "${q[@]}" --out "$tmp/m" > /dev/null 2> "$tmp/m.err" ||
        fail "mpirun -np 2 with the Prescott set exited $?: $(cat "$tmp/m.err")"
    same_checkpoint "$tmp/b" "$tmp/m" "mpirun -np 2's checkpoint" "OPENBLAS_CORETYPE=$want's"
fi
pretend quantize "$model" --out "$tmp/c" --scheme nvfp9 > /dev/null 2> "$tmp/c.err"; rc=$?
[ $rc -eq 2 ] && grep -q "nvfp9" "$tmp/c.err" || fail "a bad flag after the re-run: exit $rc, $(cat "$tmp/c.err")"
exit $((fails > 0))
