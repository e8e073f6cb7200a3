#pragma once
/* `krait plan MODEL_DIR [options]`: a checkpoint's memory plan (plan.c). Returns the exit status. */
int kr_plan_main(int argc, char **argv);
