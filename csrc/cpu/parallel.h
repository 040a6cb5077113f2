// at::parallel_for for the CPU kernels, refusing a build in which it would run on one thread.
//
// ATen's parallel_for is an inline template (ATen/ParallelOpenMP.h): it forks threads only when the
// translation unit itself is compiled with OpenMP (_OPENMP defined). Without -fopenmp it quietly runs
// the whole range on the calling thread, which halved every kernel's speed on a 2-core machine before
// this check existed. setup.py passes -fopenmp; a build without it fails here instead of running slow.
#pragma once
#include <ATen/Parallel.h>

#ifndef _OPENMP
#error "torchqkit's CPU kernels need -fopenmp: without it at::parallel_for runs on one thread (see setup.py)"
#endif
