//! Which launcher started this process, from its environment.

/// The world size an MPI launcher announced, and the variable that said so.
///
/// OpenMPI sets `OMPI_COMM_WORLD_SIZE`, MPICH/Hydra and Intel MPI `PMI_SIZE`,
/// PMIx-based launchers `PMIX_SIZE`… we read the common ones. Slurm's
/// `srun --mpi=pmix` gives each task its `PMIX_RANK` but no size: with one,
/// the step's task count (`SLURM_STEP_NUM_TASKS`) is it when above 1 (an
/// `srun -n1` under a PMIx default is one process, as without Slurm).
pub fn launcher_world_size() -> Option<(usize, &'static str)> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "MV2_COMM_WORLD_SIZE"]
        .into_iter()
        .find_map(|var| number(var).map(|n| (n, var)))
        .or_else(|| {
            let n = number("PMIX_RANK").and(number("SLURM_STEP_NUM_TASKS")).filter(|&n| n > 1);
            n.map(|n| (n, "SLURM_STEP_NUM_TASKS"))
        })
}

/// The environment variable `var` as a number.
fn number(var: &str) -> Option<usize> {
    std::env::var(var).ok().and_then(|v| v.trim().parse().ok())
}

/// The rank an MPI launcher announced.
pub fn launcher_rank() -> Option<usize> {
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK"].into_iter().find_map(number)
}
