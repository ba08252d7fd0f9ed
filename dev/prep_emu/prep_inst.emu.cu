/* One prep source (PREP_SRC, prepared by run.sh: its dynamic shared memory declaration made a pointer to the
 * emulated CTA's) in namespace PREP_NS, and its entry for the harness: prep_grid records the launcher's grid for
 * the problem's size classes. run.sh compiles this file twice, for the candidate (cand) and the reference (ref):
 * the namespaces keep the two kda_prep_kernel instances apart (without them the linker would keep one of the two
 * template instances of each name). */
#include "common.cuh"
#include "seq.cuh"
#include "cp_plan.cuh"
#include <stdio.h>

namespace PREP_NS {
#include PREP_SRC /* its includes are in already: this stand-in common.cuh (pragma once), seq.cuh, cp_plan.cuh (guards) */

/* The launcher of the problem's size classes p->pb.kc and p->pb.vc, as the forward picks its configuration row
 * (it records its grid in emu_grid): 0, or −1 for classes not instantiated here */
int prep_grid(const kda_prep_params_t *p) {
    const int kc = p->pb.kc, vc = p->pb.vc;
#define PREP_CLASS(KC, VC) \
    if (kc == KC && vc == VC) return kda_prep_launch<KC, VC>(p, 0, NULL);
    PREP_CLASS(64, 64)
    PREP_CLASS(64, 128)
    PREP_CLASS(128, 64)
    PREP_CLASS(128, 128)
    PREP_CLASS(64, 256)
    PREP_CLASS(128, 256)
    PREP_CLASS(256, 64)
    PREP_CLASS(256, 128)
    PREP_CLASS(256, 256)
#undef PREP_CLASS
    fprintf(stderr, "prep_emu: classes (%d, %d) are not instantiated\n", kc, vc);
    return -1;
}
} /* namespace PREP_NS */
