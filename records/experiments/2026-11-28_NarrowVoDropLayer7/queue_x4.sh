#!/usr/bin/env bash
# Four H200s (nvidia-h200-x4, ~25 minutes held with staging): six quality lanes on GPUs 0-1, three
# schedule lanes from record #92 on GPU 2, and the timing runs alone on GPU 3 from the start. Proxy train
# shards 1-4, rank-slice (setup: SHARDS='proxy_train_00000[1-4].bin.xz proxy_val_000000.bin.xz' bash bench/lease.sh setup).
#   quality: three eager lanes per GPU (their losses count, their times do not), SEEDS=1,2,3 each;
#     GPU 0: main / NARROW_VO_LAYERS=0,5,7 / NARROW_VO_LAYERS=5,7
#     GPU 1: layer 7 dropped / layer 7 dropped with NARROW_VO_LAYERS=0,5 / ORTHOGONALIZER=polar_express5_l3e3,
#            beside them the GPU tests of narrow V/O and of the FP8 MLP with layer 7 dropped
#     GPU 2: the taper row at batch 20 (327,680 tokens) / that and the extension at batch 8 (131,072) /
#            3072-token documents without the 2560 attention cap (T5.5)
#   time: GPU 3, alone on its GPU with the step graphs, seed 1, one after the other: layer 7 dropped, main,
#     narrow V/O on 0,5,7, then the record's batch taper and extension (the eager lanes keep the host's
#     other GPUs busy throughout, the same for every run of the sequence)
# arm, check, note, need_shards, watch_gpus: bench/lease.sh.
need_shards 1 2 3 4
watch_gpus 60
DROP7="ATTENTION_LAYERS=0,1,2,3,5,8,10 MLP_LAYERS=0,1,2,3,4,5,6,8,9,10 NARROW_QK_LAYERS=0,1,2,5,8"
TAPER20="STAGE_BATCH_TOKENS=131072,262144,393216,327680,393216"
TAPER20EXT8="STAGE_BATCH_TOKENS=131072,262144,393216,327680,131072"
note "quality lanes: GPU 0 main, narrow V/O 0,5,7 and 5,7; GPU 1 layer 7 dropped, with narrow V/O 0,5, five maps from 3e-3; GPU 2 batch-20 taper, with batch-8 extension, no attention cap"
note "timing on GPU 3: layer 7 dropped, main, narrow V/O 0,5,7, batch-20 taper with batch-8 extension; graphs on, seed 1"
( arm 0 main CUDA_GRAPHS=0 ) & p1=$!
( arm 0 nvo057 CUDA_GRAPHS=0 NARROW_VO_LAYERS=0,5,7 ) & p2=$!
( arm 0 nvo57 CUDA_GRAPHS=0 NARROW_VO_LAYERS=5,7 ) & p3=$!
( arm 1 drop7 CUDA_GRAPHS=0 $DROP7 ) & p4=$!
( arm 1 drop7nvo05 CUDA_GRAPHS=0 $DROP7 NARROW_VO_LAYERS=0,5 ) & p5=$!
( arm 1 maps5l3e3 CUDA_GRAPHS=0 ORTHOGONALIZER=polar_express5_l3e3 ) & p6=$!
( check 1 gpu_tests 900 python -m pytest -q -m gpu tests/model/test_narrow_vo.py tests/kernels/test_mlp.py \
      -k "narrow_vo or fp8_mlp_trains" ) & p7=$!
( arm 2 taper20 CUDA_GRAPHS=0 $TAPER20 ) & p8=$!
( arm 2 taper20ext8 CUDA_GRAPHS=0 $TAPER20EXT8 ) & p9=$!
( arm 2 nocap CUDA_GRAPHS=0 STAGE_ATTENTION_CAP=0,0,0,0,0 ) & p10=$!
( SEEDS=1 arm 3 t_drop7 $DROP7; SEEDS=1 arm 3 t_main; SEEDS=1 arm 3 t_nvo057 NARROW_VO_LAYERS=0,5,7
  SEEDS=1 arm 3 t_taper20ext8 $TAPER20EXT8 ) & p11=$!
wait $p1 $p2 $p3 $p4 $p5 $p6 $p7 $p8 $p9 $p10
python records/tool.py ablation $L/main_s*.txt $L/nvo057_s*.txt $L/nvo57_s*.txt $L/drop7_s*.txt $L/drop7nvo05_s*.txt \
    $L/maps5l3e3_s*.txt $L/taper20_s*.txt $L/taper20ext8_s*.txt $L/nocap_s*.txt > $L/ablation.md 2>&1
note "ablation rc=$?"
wait $p11
python records/tool.py stages $L/t_*_s1.txt > $L/timing_stages.md 2>&1
note "timing stages rc=$?"
