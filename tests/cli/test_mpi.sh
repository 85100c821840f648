#!/usr/bin/env bash
# mpirun -np 1|2|3 moeq quantize on localhost writes checkpoints byte-identical to one process's
# (GPTQ NVFP4 on the bundled OLMoE, INT4 act-order on a model with a shared expert when the
# shared fixtures are there; both also with --target unquantized); a rank killed mid-layer stops the job naming it, and --resume with
# another rank count finishes identically; a rank that fails makes every rank stop with its
# message; a rank that hangs makes the others give up after --mpi-timeout. Skips (77) without
# mpirun or on a build without MPI.
. "$(dirname "$0")/common.sh"

command -v mpirun >/dev/null || { echo "SKIP: mpirun not found (apt install openmpi-bin)"; exit 77; }
"$cli" --version | grep -q "^MPI: Open MPI" || { echo "SKIP: this moeq was built without MPI"; exit 77; }
# containers run as root; Open MPI wants to be told that is intended
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# localhost only, no network probing, quiet about missing high-speed transports
export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_plm_rsh_agent=false
run_np() { local np=$1; shift; timeout 300 mpirun --oversubscribe -np "$np" "$cli" "$@"; }

calib=$repo/data/demo-calib.txt
args=(--scheme nvfp4a16 --method gptq --calib "$calib" --nsamples 8 --seqlen 64 --expert-chunk 3
      --threads 1 --quiet)

same() {
    same_checkpoint "$1" "$2" "$3" "the single-process run"
    [ -f "$2/gptq_report.json" ] || fail "$3: no report"
}

"$cli" quantize "$model" --out "$tmp/base" "${args[@]}" || fail "the single-process run exited $?"
for np in 1 2 3; do
    run_np "$np" quantize "$model" --out "$tmp/np$np" "${args[@]}" || fail "-np $np exited $?"
    same "$tmp/base" "$tmp/np$np" "-np $np"
    ls -d "$tmp"/np$np.moeq-work* 2>/dev/null && fail "-np $np left a work directory"
done

# the experts' shares fitted to the ranks' measured seconds (MOEQ_DIST_SHARES=measured): other
# splits, the same bytes; the fit logged where it changed the weights
MOEQ_DIST_SHARES=measured MOEQ_DIST_PROFILE=1 run_np 3 quantize "$model" --out "$tmp/mnp3" \
    "${args[@]:0:${#args[@]}-1}" 2>"$tmp/measured.log" || fail "MOEQ_DIST_SHARES=measured -np 3 exited $?"
same "$tmp/base" "$tmp/mnp3" "MOEQ_DIST_SHARES=measured -np 3"
grep -q "experts' shares: GPTQ weighted" "$tmp/measured.log" || echo "note: no layer's fit changed the shares"

# an expert-balanced calibration: each rank streams its share of the candidates, the counts go to
# every rank, and all choose the same samples
"$cli" quantize "$model" --out "$tmp/bbase" "${args[@]}" --calib-balance experts || fail "--calib-balance exited $?"
for np in 2 3; do
    run_np "$np" quantize "$model" --out "$tmp/bnp$np" "${args[@]}" --calib-balance experts || fail "--calib-balance -np $np exited $?"
    same "$tmp/bbase" "$tmp/bnp$np" "--calib-balance experts -np $np"
done

# the unquantized target (asymmetric calibration): its cross sums relayed like the Hessians,
# the unquantized stream shared like the quantized one
"$cli" quantize "$model" --out "$tmp/tbase" "${args[@]}" --target unquantized || fail "--target unquantized exited $?"
for np in 2 3; do
    run_np "$np" quantize "$model" --out "$tmp/tnp$np" "${args[@]}" --target unquantized || fail "--target -np $np exited $?"
    same "$tmp/tbase" "$tmp/tnp$np" "--target unquantized -np $np"
done
# killed inside layer 2 with 2 ranks, resumed with 3 from the snapshot of both streams
MOEQ_FAULT=chunk:2:0 MOEQ_FAULT_RANK=1 run_np 2 quantize "$model" --out "$tmp/tk" "${args[@]}" --target unquantized \
    >"$tmp/tkill.log" 2>&1
[ -f "$tmp/tk.moeq-work/manifest.json" ] || fail "--target: no work manifest after the kill"
run_np 3 quantize "$model" --out "$tmp/tk" "${args[@]}" --target unquantized --resume || fail "--target --resume -np 3 exited $?"
same "$tmp/tbase" "$tmp/tk" "--target unquantized killed, resumed with 3 ranks"

shared=${MOEQ_SHARED:-$repo/../shared}
q2=$shared/fixtures/models/qwen2moe-tiny
if [ -d "$q2" ]; then
    a2=(--scheme int4 --method gptq --calib "$calib" --nsamples 8 --seqlen 64 --threads 1 --quiet)
    "$cli" quantize "$q2" --out "$tmp/q2base" "${a2[@]}" || fail "qwen2moe single process exited $?"
    run_np 3 quantize "$q2" --out "$tmp/q2np3" "${a2[@]}" || fail "qwen2moe -np 3 exited $?"
    same "$tmp/q2base" "$tmp/q2np3" "qwen2moe-tiny -np 3"
    "$cli" quantize "$q2" --out "$tmp/q2tbase" "${a2[@]}" --target unquantized || fail "qwen2moe --target exited $?"
    run_np 3 quantize "$q2" --out "$tmp/q2tnp3" "${a2[@]}" --target unquantized || fail "qwen2moe --target -np 3 exited $?"
    same "$tmp/q2tbase" "$tmp/q2tnp3" "qwen2moe-tiny --target unquantized -np 3"
else
    echo "note: $q2 not found; the shared-expert case is skipped"
fi

# a rank killed inside layer 1's experts: the job stops (no hang), mpirun names the rank
MOEQ_FAULT=chunk:1:0 MOEQ_FAULT_RANK=1 run_np 2 quantize "$model" --out "$tmp/k" "${args[@]}" \
    >"$tmp/kill.log" 2>&1
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] || fail "the job with a killed rank exited $rc"
grep -q "rank 1" "$tmp/kill.log" || fail "the killed rank is not named: $(cat "$tmp/kill.log")"
[ -e "$tmp/k" ] && fail "OUT_DIR exists after the kill"
[ -f "$tmp/k.moeq-work/manifest.json" ] || fail "no work manifest after the kill"
run_np 3 quantize "$model" --out "$tmp/k" "${args[@]}" --resume || fail "--resume with 3 ranks exited $?"
same "$tmp/base" "$tmp/k" "killed, resumed with 3 ranks"
[ -e "$tmp/k.moeq-work" ] && fail "the work directory is left after the resumed run"

# a rank that fails: every rank stops with that rank's message
MOEQ_FAULT=chunk:2:0 MOEQ_FAULT_RANK=2 MOEQ_FAULT_MODE=error run_np 3 quantize "$model" \
    --out "$tmp/e" "${args[@]}" >"$tmp/err.log" 2>&1
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] || fail "the job with a failing rank exited $rc"
n=$(grep -c "error: rank 2: layer 2, expert chunk 0: injected fault" "$tmp/err.log")
[ "$n" = 3 ] || fail "expected the failure on all 3 ranks, got $n: $(cat "$tmp/err.log")"
[ -e "$tmp/e" ] && fail "OUT_DIR exists after a failed run"
run_np 2 quantize "$model" --out "$tmp/e" "${args[@]}" --resume || fail "--resume after the failure exited $?"
same "$tmp/base" "$tmp/e" "failed, resumed with 2 ranks"

# a rank that hangs: the others give up after --mpi-timeout, and the job ends
t0=$(date +%s)
MOEQ_FAULT=chunk:1:0 MOEQ_FAULT_RANK=1 MOEQ_FAULT_MODE=hang run_np 2 quantize "$model" \
    --out "$tmp/h" "${args[@]}" --mpi-timeout 3 >"$tmp/hang.log" 2>&1
rc=$?
t1=$(date +%s)
[ $rc -ne 0 ] && [ $rc -ne 124 ] || fail "the job with a hung rank exited $rc (124: it hung)"
grep -q "did not reach 'layer 1: experts' within 3 s; rank 1 does not answer: lost or hung" "$tmp/hang.log" ||
    fail "no timeout message naming the hung rank: $(cat "$tmp/hang.log")"
[ $((t1 - t0)) -lt 120 ] || fail "the hung job took $((t1 - t0)) s to stop"

# the scaling benchmark: one job, the first 1 and then 2 ranks, a table row for each
# (two rounds, 1,2,1,2: the rows are medians, and each round's own efficiency is printed)
run_np 2 bench quantize "$model" --layers 1 --nsamples 4 --seqlen 32 --threads 1 --ranks 1,2 --rounds 2 \
    >"$tmp/bench.log" 2>&1 || fail "bench quantize --ranks 1,2 exited $?: $(tail -5 "$tmp/bench.log")"
grep -qE "^efficiency of 2 ranks in each round: [0-9.]+ [0-9.]+$" "$tmp/bench.log" ||
    fail "no per-round efficiencies: $(cat "$tmp/bench.log")"
grep -qE "^ +1 +[0-9.]+ +1\.000 +1\.00 +1\.00 +[0-9.]+$" "$tmp/bench.log" || fail "no 1-rank row: $(cat "$tmp/bench.log")"
grep -qE "^ +2 +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ [0-9.]+$" "$tmp/bench.log" || fail "no 2-rank row with 2 peaks: $(cat "$tmp/bench.log")"
# the 2-rank core rate was measured (positive) and "of ceiling" is the efficiency over it, to
# the printed digits: each of the three is rounded to 0.005, so the quotient of the printed
# efficiency e and core rate c may differ from the printed ratio by 0.005 (1 + 1/c + e/c^2) (a
# rate of 0.5 under load makes that 0.025)
awk '$1 == 2 && NF == 7 { tol = 0.005 * (1 + 1 / $4 + $3 / ($4 * $4)) + 1e-9
                          ok = $4 > 0 && ($5 - $3 / $4) ^ 2 <= tol ^ 2 } END { exit !ok }' "$tmp/bench.log" ||
    fail "2-rank core rate or its ceiling ratio wrong: $(grep -E '^ +2 ' "$tmp/bench.log")"
# without a list: one row, its own core rate (1.00, not an unmeasured 0.00)
run_np 2 bench quantize "$model" --layers 1 --nsamples 4 --seqlen 32 --threads 1 >"$tmp/bench1.log" 2>&1 ||
    fail "bench quantize under mpirun exited $?: $(tail -5 "$tmp/bench1.log")"
grep -qE "^ +2 +[0-9.]+ +1\.000 +1\.00 +1\.00 +[0-9.]+ [0-9.]+$" "$tmp/bench1.log" ||
    fail "no 2-rank row with its core rate: $(cat "$tmp/bench1.log")"
run_np 2 bench quantize "$model" --layers 1 --ranks 3 >/dev/null 2>&1 && fail "--ranks 3 on a 2-rank job was accepted"

# eval over 1, 2 and 3 ranks (each runs a share of the windows, rank 0 gathers): the single
# process's numbers and saved-logits file, whole and streamed, with the quantized checkpoint
# against the bundled model as its --kl-base
head -c 12000 "$calib" > "$tmp/eval.txt"
eargs=(--data "$tmp/eval.txt" --task text --max-length 48 --kl-base "$model" --entropy --threads 1 --json)
"$cli" eval "$tmp/base" "${eargs[@]}" --save-logits "$tmp/e1.topk" > "$tmp/e1.json" 2>/dev/null ||
    fail "eval, one process, exited $?"
for np in 2 3; do
    for stream in off on; do
        run_np "$np" eval "$tmp/base" "${eargs[@]}" --stream "$stream" --save-logits "$tmp/e$np$stream.topk" \
            > "$tmp/e$np$stream.json" 2>"$tmp/e.err" || fail "eval -np $np --stream $stream exited $?: $(cat "$tmp/e.err")"
        for key in loglikelihood kl_mean kl_p99 top1_changed entropy_mean documents tokens; do
            [ "$(json_get "$tmp/e$np$stream.json" $key)" = "$(json_get "$tmp/e1.json" $key)" ] ||
                fail "eval -np $np --stream $stream: $key $(json_get "$tmp/e$np$stream.json" $key) against $(json_get "$tmp/e1.json" $key)"
        done
        cmp -s "$tmp/e1.topk" "$tmp/e$np$stream.topk" || fail "eval -np $np --stream $stream: the saved logits differ"
    done
done
[ "$(json_get "$tmp/e1.json" kl_mean)" != 0 ] || fail "eval: the KL of a quantized model to its base is 0"

exit $((fails > 0))
