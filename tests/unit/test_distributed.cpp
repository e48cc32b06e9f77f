// Data-parallel building blocks that need no process group: the per-rank shard of the data.
#include <gtest/gtest.h>
#include <difftrain/distributed/sampler.hpp>

#include <set>
#include <vector>

#include "golden.hpp"

namespace dist = difftrain::distributed;
namespace tst = difftrain::test;

TEST(DistributedSampler, EveryConfigurationGivesTorchsIndices) {
  const auto& cases = tst::golden("distributed_sampler.json")["cases"];
  ASSERT_GT(cases.size(), 1000U);
  for (const auto& c : cases) {
    dist::DistributedSampler s(c["n"].get<std::int64_t>(),
                               {.num_replicas = c["replicas"].get<std::int64_t>(),
                                .rank = c["rank"].get<std::int64_t>(),
                                .shuffle = c["shuffle"].get<bool>(),
                                .seed = c["seed"].get<std::uint64_t>(),
                                .drop_last = c["drop_last"].get<bool>()});
    s.set_epoch(c["epoch"].get<std::int64_t>());
    EXPECT_EQ(s.indices(), c["indices"].get<std::vector<std::int64_t>>()) << c.dump();
    EXPECT_EQ(s.size(), c["len"].get<std::int64_t>()) << c.dump();
  }
}

TEST(DistributedSampler, RanksSplitAnEpochAndBadSettingsAreConfigErrors) {
  // Without drop_last the ranks together cover every index (some twice, as padding).
  std::set<std::int64_t> seen;
  for (std::int64_t r = 0; r < 3; ++r) {
    dist::DistributedSampler s(10, {.num_replicas = 3, .rank = r, .seed = 5});
    s.set_epoch(2);
    for (auto i : s.indices()) seen.insert(i);
  }
  EXPECT_EQ(seen.size(), 10U);
  EXPECT_THROW(dist::DistributedSampler(10, {.num_replicas = 0}), difftrain::ConfigError);
  EXPECT_THROW(dist::DistributedSampler(10, {.num_replicas = 2, .rank = 2}),
               difftrain::ConfigError);
  EXPECT_THROW(dist::DistributedSampler(-1, {}), difftrain::ConfigError);
}
