# The loss-per-step arm's settings (README), sourced by queue_record.sh and queue_rowwise.sh from the repository root
PER_STEP="ATTENTION_LAYERS=0,1,2,3,4,5,7,8,9,10 MLP_LAYERS=0,1,2,3,4,5,6,7,8,9,10 VALUE_EMBED_LAYERS=1,2,8,9,10
NARROW_QK_LAYERS=0,1,2,4,5,7,8,9 NUM_SCHEDULED_ITERATIONS=1255 TAPER_FRACTION=0 STAGE_CE_CANDIDATES=0,0,0,0"
