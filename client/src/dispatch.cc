// Which live target gets which batch, and the supervisor that keeps the feed
// moving: hung targets, no target at all, DNS discovery, ended streams.
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/src/feed_impl.h"
#include "client/src/target_info.h"

namespace draftfeed {

// Sends unassigned batches, oldest first, each to the live target that would
// finish it soonest: (its outstanding tokens + this batch) / its measured
// rate. When that target has no free credit the batch waits for it rather
// than going to a slower target, so one slow target cannot hold the
// head of an ordered feed.
void Feed::Impl::Dispatch() {
  while (!unassigned.empty()) {
    const uint64_t id = *unassigned.begin();
    Pending& p = pending.at(id);
    const double tokens = static_cast<double>(p.token_ids.size());
    double known = 0;
    int n_known = 0;
    for (auto& t : targets) {
      if (t->state == State::kLive && t->rate_tps > 0) {
        known += t->rate_tps;
        ++n_known;
      }
    }
    const double default_rate = n_known > 0 ? known / n_known : 1.0;
    Target* best = nullptr;
    double best_eta = 0;
    for (auto& t : targets) {
      if (t->state != State::kLive) continue;
      const double rate = t->rate_tps > 0 ? t->rate_tps : default_rate;
      const double eta = (static_cast<double>(t->stats.outstanding_tokens) + tokens) / rate;
      if (best == nullptr || eta < best_eta) {
        best = t.get();
        best_eta = eta;
      }
    }
    if (best == nullptr || best->stats.outstanding_batches >= best->credits) return;
    unassigned.erase(unassigned.begin());
    p.target = best;
    p.conn = best->conn.get();
    // The stream's transport gives the batch a buffer as its bytes come.
    p.buffer.reset();
    p.device = -1;
    p.transport_checksum.reset();
    p.tokens_received = 0;
    p.last_progress = Clock::now();
    ++best->stats.outstanding_batches;
    best->stats.outstanding_tokens += static_cast<int64_t>(p.token_ids.size());
    v1::StreamRequest req;
    v1::Batch* b = req.mutable_batch();
    b->set_batch_id(id);
    b->mutable_token_ids()->Add(p.token_ids.begin(), p.token_ids.end());
    b->mutable_seq_lens()->Add(p.seq_lens.begin(), p.seq_lens.end());
    {
      std::lock_guard<std::mutex> wlock(p.conn->wmu);
      p.conn->wq.push_back(ToBuffer(req));
    }
    p.conn->wcv.notify_one();
  }
}

bool Feed::Impl::AnyLive() const {
  for (const auto& t : targets) {
    if (t->state == State::kLive) return true;
  }
  return false;
}

std::string Feed::Impl::TargetErrors() const {
  std::vector<std::string> why;
  for (const auto& t : targets) {
    why.push_back(absl::StrCat(t->address, ": ",
                               t->stats.last_error.empty() ? "no answer" : t->stats.last_error));
  }
  return absl::StrJoin(why, "; ");
}

void Feed::Impl::SuperviseLoop() {
  std::unique_lock<std::mutex> lock(mu);
  while (!closing) {
    const Clock::time_point now = Clock::now();
    Dispatch();
    RecordWindowsLocked();
    // Hung targets: a batch without progress, and its stream without any,
    // for batch_timeout_s.
    for (auto& [id, p] : pending) {
      if (p.complete || p.conn == nullptr) continue;
      const Clock::time_point last = std::max(p.last_progress, p.conn->last_progress);
      if (now - last > std::chrono::duration<double>(options.batch_timeout_s)) {
        Target* t = p.target;
        t->stats.last_error = absl::StrCat("no progress on batch ", id, " for ",
                                           options.batch_timeout_s, "s; treating it as hung");
        if (t->state == State::kLive) t->state = State::kDown;
        p.conn->stream.TryCancel();  // the reader re-sends its batches
        p.last_progress = now;
      }
    }
    // No live target while work waits: fail after unavailable_timeout_s.
    const bool work_waiting = !pending.empty();
    if (AnyLive() || !work_waiting) {
      no_target_since.reset();
    } else if (!no_target_since) {
      no_target_since = now;
    } else if (fatal.ok() && now - *no_target_since >
                                 std::chrono::duration<double>(options.unavailable_timeout_s)) {
      fatal = absl::UnavailableError(absl::StrCat(
          "no target reachable for ", options.unavailable_timeout_s, "s: ", TargetErrors()));
      for (auto& [id, p] : pending) {
        if (!p.complete) Fail(id, p, fatal);
      }
      cv.notify_all();
    }
    // DNS discovery.
    if (!dns_targets.empty() && now >= next_dns_refresh) {
      next_dns_refresh =
          now + std::chrono::milliseconds(static_cast<int64_t>(options.dns_refresh_s * 1000));
      std::vector<std::string> names = dns_targets;
      lock.unlock();
      std::vector<std::pair<std::string, std::string>> found;  // address, its dns name
      for (const std::string& n : names) {
        if (auto r = ExpandTarget(n); r.ok()) {
          for (std::string& a : *r) found.emplace_back(std::move(a), DnsNameOf(n));
        }
      }
      lock.lock();
      for (const auto& [a, name] : found) AddTargetLocked(a, name);
    }
    // Join the threads of ended streams.
    for (auto it = dead_conns.begin(); it != dead_conns.end();) {
      std::shared_ptr<Conn> c = *it;
      it = dead_conns.erase(it);
      lock.unlock();
      if (c->reader.joinable()) c->reader.join();
      lock.lock();
    }
    cv.wait_for(lock, std::chrono::milliseconds(20));
  }
}

absl::Status Feed::Impl::AddTargets(const std::string& target) {
  auto addresses = ExpandTarget(target);
  if (!addresses.ok()) return addresses.status();
  std::lock_guard<std::mutex> lock(mu);
  if (target.rfind("dns:///", 0) == 0) dns_targets.push_back(target);
  for (const std::string& a : *addresses) AddTargetLocked(a, DnsNameOf(target));
  cv.notify_all();
  return absl::OkStatus();
}

}  // namespace draftfeed
