// spectral-cond-mpi: `spectral-cond analyze` spread over the ranks of an MPI job.
//
//   mpirun -np 4 spectral-cond-mpi analyze CHECKPOINT --jacobian [analyze's options]
//          --format json [--out FILE]
//
// Rank r computes shard r/size of the κ(J) work items (one per head of every self-attention
// layer, as `analyze --shard r/size`); rank 0 gathers the shards' JSON reports, merges them
// (merge.hpp) and writes the one report, which is the single-process report (the "seconds"
// timings aside). Rank 0 alone draws progress and prints errors; every rank exits with the code
// of the lowest-numbered rank that failed (cli.hpp lists the codes).
#include <spectral_cond/engine/blas_threads.hpp>
#include <spectral_cond/engine/inputs.hpp>
#include "commands.hpp"
#include <spectral_cond/engine/merge.hpp>
#include "run.hpp"

#include <spectral_cond/io/files.hpp>

#include <mpi.h>

#include <CLI/CLI.hpp>

#include <climits>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace {

using spectral_cond::cli::Error;

/// Gathers every rank's (code, text) on rank 0. On rank 0 returns the merged report's text, or
/// throws the failing rank's error; elsewhere returns nothing, or throws an Error without a
/// message (rank 0 prints it) when any rank failed.
std::optional<std::string> gather(const std::string& text, int code, int rank, int size) {
  if (text.size() > static_cast<std::size_t>(INT_MAX))
    throw Error(spectral_cond::cli::kInternalError, "a shard report over 2 GiB");
  const int my[2] = {code, static_cast<int>(text.size())};
  std::vector<int> heads(rank == 0 ? 2 * static_cast<std::size_t>(size) : 0);
  MPI_Gather(my, 2, MPI_INT, heads.data(), 2, MPI_INT, 0, MPI_COMM_WORLD);
  std::vector<int> counts, offsets;
  std::string all;
  if (rank == 0) {
    long long total = 0;
    for (int r = 0; r < size; ++r) {
      counts.push_back(heads[2 * static_cast<std::size_t>(r) + 1]);
      offsets.push_back(static_cast<int>(total));
      total += counts.back();
      if (total > INT_MAX)
        throw Error(spectral_cond::cli::kInternalError, "the shard reports exceed 2 GiB together");
    }
    all.resize(static_cast<std::size_t>(total));
  }
  MPI_Gatherv(text.data(), my[1], MPI_CHAR, all.data(), counts.data(), offsets.data(), MPI_CHAR, 0,
              MPI_COMM_WORLD);
  // The code of the lowest failing rank, for every rank.
  int failed = -1;
  if (rank == 0)
    for (int r = 0; r < size && failed < 0; ++r)
      if (heads[2 * static_cast<std::size_t>(r)] != 0) failed = r;
  int status[2] = {failed, failed >= 0 ? heads[2 * static_cast<std::size_t>(failed)] : 0};
  MPI_Bcast(status, 2, MPI_INT, 0, MPI_COMM_WORLD);
  if (status[0] >= 0) {
    if (rank != 0) throw Error(status[1], "");
    const auto r = static_cast<std::size_t>(status[0]);
    std::string msg =
        all.substr(static_cast<std::size_t>(offsets[r]), static_cast<std::size_t>(counts[r]));
    if (status[0] != 0) msg = "rank " + std::to_string(status[0]) + ": " + msg;
    throw Error(status[1], msg);
  }
  if (rank != 0) return std::nullopt;
  if (size == 1) return all;
  std::vector<nlohmann::json> docs;
  std::vector<std::string> names;
  for (int r = 0; r < size; ++r) {
    const auto i = static_cast<std::size_t>(r);
    docs.push_back(nlohmann::json::parse(
        all.substr(static_cast<std::size_t>(offsets[i]), static_cast<std::size_t>(counts[i]))));
    names.push_back("rank " + std::to_string(r));
  }
  return spectral_cond::cli::json_text(spectral_cond::cli::merge_shards(docs, names));
}

}  // namespace

int main(int argc, char** argv) {
  using namespace spectral_cond;
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  io::install_signal_cleanup();
  io::protect_inputs();
  cli::pin_blas_to_one_thread();  // the same report on any machine (blas_threads.hpp)
  CLI::App app{"spectral-cond analyze over the ranks of an MPI job (docs/cli.md).",
               "spectral-cond-mpi"};
  app.set_version_flag("--version", std::string("spectral-cond-mpi ") + SPECTRAL_COND_VERSION);
  app.require_subcommand(1);
  cli::AnalyzeDistribution dist;
  dist.rank = static_cast<std::uint64_t>(rank);
  dist.size = static_cast<std::uint64_t>(size);
  dist.gather = [rank, size](const std::string& text, int code) {
    return gather(text, code, rank, size);
  };
  cli::register_analyze(app, &dist);
  const int code = cli::run_app(app, argc, argv, "spectral-cond-mpi", rank == 0);
  MPI_Finalize();
  return code;
}
