// Step-keyed accumulators: where the owners' contributions to one
// between-graph secure sum meet on a server.
//
// In between-graph mode every data owner runs only its own graph; its
// contribution to a sum (a fresh key for server0, a masked share for server1)
// goes into an accumulator on the server that every owner's graph names
// alike (shared_name). The accumulator holds ring words or keys only, never
// adds them (the server's TfeServerSum does), and enforces the sum's rules:
//
//   TfeStepAccumulator(owners, dtype, shape, shared_name) -> handle
//   TfeStepPut(handle, step, value; owner)     one contribution of `owner` to `step`
//   TfeStepTake(handle, step) -> values[N]      waits until all N owners put `step`
//   TfeStepRewind(handle, step; owner)          `owner` restored checkpoint `step` (a new session)
//
// - exactly one contribution per owner and step: a second one for the same
//   step is refused (AlreadyExists), and so is one for another step while the
//   owner's last one is not yet taken;
// - a stale step (at or below the last step taken) is refused, unless its
//   owner rewound to it (below);
// - a put for a step other than the one being taken is refused (owners out
//   of step), naming the owner and both steps;
// - a step is released (TfeStepTake returns) only when every owner put it;
//   the take waits asynchronously and is cancelled with its step (the
//   session's timeout or a failed task), naming the owners still missing and
//   the step each one's contribution is for;
// - a rewind (each owner's first act in a new session, after its restore:
//   the owners' handshake) drops that owner's contribution left by its failed
//   session and lets that owner contribute again from the restored step, so
//   that owners that all recovered from the same checkpoint continue (a step
//   completes only when every owner put it, so only when all rewound). It
//   touches only its owner's state: it cannot race with the others' puts.
//
// Every refusal names the channel (the shared name), the owners and the
// steps, and says how to fix it.
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/platform/mutex.h"

namespace tfe_estimator {
namespace {

namespace tf = ::tensorflow;

// An owner that has not rewound since the last release.
const int64_t kNotRewound = std::numeric_limits<int64_t>::max();

constexpr char kRestart[] =
    " Restart every task of the cluster (servers and owners) so that every owner resumes from the same "
    "checkpoint step.";

struct Waiter;

class StepAccumulator : public tf::ResourceBase {
 public:
  StepAccumulator(std::string channel, std::vector<std::string> owners, tf::DataType dtype, tf::TensorShape shape)
      : channel_(std::move(channel)), owners_(std::move(owners)), dtype_(dtype), shape_(std::move(shape)),
        slots_(owners_.size()), rewound_(owners_.size(), kNotRewound) {}
  ~StepAccumulator() override;

  std::string DebugString() const override {
    return tf::strings::StrCat("TfeStepAccumulator ", channel_, " of ", owners_.size(), " owners");
  }

  // The creator's settings must equal every later user's.
  tf::Status Verify(const std::vector<std::string>& owners, tf::DataType dtype, const tf::TensorShape& shape) const {
    if (owners != owners_ || dtype != dtype_ || shape != shape_) {
      return tf::errors::InvalidArgument(
          "Between-graph secure sum ", channel_, ": this owner's graph expects owners [", Join(owners), "] and ",
          tf::DataTypeString(dtype), shape.DebugString(), " contributions, but the server's accumulator holds owners [",
          Join(owners_), "] and ", tf::DataTypeString(dtype_), shape_.DebugString(),
          " contributions. Every owner must run the same model with the same TfeRunConfig and cluster.");
    }
    return OkStatus();
  }

  int num_owners() const { return static_cast<int>(owners_.size()); }

  // Owner `owner`'s contribution to `step`. Returns the waiting take it completes, if any.
  tf::Status Put(int owner, int64_t step, const tf::Tensor& value, std::unique_ptr<Waiter>* completed);

  // Owner `owner` starts a session restored at checkpoint `step`: drops its unreleased contribution and
  // may contribute to `step` and later steps again, even if they were released.
  tf::Status Rewind(int owner, int64_t step) {
    if (owner < 0 || owner >= num_owners()) {
      return tf::errors::InvalidArgument("Between-graph secure sum ", channel_, ": owner index ", owner,
                                         " is not one of the ", num_owners(), " owners [", Join(owners_), "].");
    }
    tf::mutex_lock lock(mu_);
    slots_[owner] = Slot();
    rewound_[owner] = step;
    return OkStatus();
  }

  // Waits until every owner put `step`, then outputs the contributions in owner order.
  void Take(int64_t step, tf::OpKernelContext* ctx, tf::AsyncOpKernel::DoneCallback done);

 private:
  struct Slot {
    bool full = false;
    int64_t step = 0;
    tf::Tensor value;
  };

  static std::string Join(const std::vector<std::string>& names) {
    std::string out;
    for (const auto& n : names) tf::strings::StrAppend(&out, out.empty() ? "" : ", ", n);
    return out;
  }

  std::string Missing(int64_t step) const TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<std::string> missing;
    for (size_t o = 0; o < slots_.size(); ++o) {
      if (!slots_[o].full) {
        missing.push_back(owners_[o] + " (no contribution)");
      } else if (slots_[o].step != step) {
        missing.push_back(tf::strings::StrCat(owners_[o], " (a contribution to step ", slots_[o].step, ")"));
      }
    }
    return Join(missing);
  }

  bool Complete(int64_t step) const TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& slot : slots_) {
      if (!slot.full || slot.step != step) return false;
    }
    return true;
  }

  // Empties the slots of a complete step into `values` and marks the step released.
  void Release(int64_t step, std::vector<tf::Tensor>* values) TF_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (auto& slot : slots_) {
      values->push_back(std::move(slot.value));
      slot = Slot();
    }
    released_ = step;
    has_released_ = true;
    rewound_.assign(rewound_.size(), kNotRewound);  // a replay of a released step is stale again
  }

  // Take's part under the lock: releases a complete step into the waiter, or keeps the waiter (leaving null).
  tf::Status TakeOrWait(std::unique_ptr<Waiter>* waiter);
  void Cancel(tf::CancellationManager* cm, tf::CancellationToken token);

  const std::string channel_;
  const std::vector<std::string> owners_;
  const tf::DataType dtype_;
  const tf::TensorShape shape_;
  tf::mutex mu_;
  std::vector<Slot> slots_ TF_GUARDED_BY(mu_);
  bool has_released_ TF_GUARDED_BY(mu_) = false;
  int64_t released_ TF_GUARDED_BY(mu_) = 0;
  std::vector<int64_t> rewound_ TF_GUARDED_BY(mu_);  // per owner: the step it rewound to since the last release
  std::unique_ptr<Waiter> waiter_ TF_GUARDED_BY(mu_);
};

// A take waiting for its step; finished outside the accumulator's lock.
struct Waiter {
  int64_t step;
  tf::OpKernelContext* ctx;
  tf::AsyncOpKernel::DoneCallback done;
  tf::CancellationToken token;
  bool registered;               // whether `token` holds a cancellation callback
  StepAccumulator* accumulator;  // holds one reference while waiting
  std::vector<tf::Tensor> values;

  // Outputs the values (or `status`), lets go of the cancellation callback and the accumulator, calls done.
  void Finish(const tf::Status& status) {
    if (status.ok()) {
      for (size_t i = 0; i < values.size(); ++i) ctx->set_output(static_cast<int>(i), values[i]);
    } else {
      ctx->SetStatus(status);
    }
    // Blocks while the callback runs, so no Cancel can come after the reference goes. Cancel itself clears
    // `registered` first: a callback must not wait for itself.
    if (registered) ctx->cancellation_manager()->DeregisterCallback(token);
    auto finish = std::move(done);
    accumulator->Unref();
    finish();
  }
};

// A waiter holds a reference, so none is left when the resource goes.
StepAccumulator::~StepAccumulator() = default;

tf::Status StepAccumulator::Put(int owner, int64_t step, const tf::Tensor& value,
                                std::unique_ptr<Waiter>* completed) {
  if (owner < 0 || owner >= num_owners()) {
    return tf::errors::InvalidArgument("Between-graph secure sum ", channel_, ": owner index ", owner,
                                       " is not one of the ", num_owners(), " owners [", Join(owners_), "].");
  }
  const std::string& me = owners_[owner];
  if (value.dtype() != dtype_ || value.shape() != shape_) {
    return tf::errors::InvalidArgument("Between-graph secure sum ", channel_, ": ", me, " contributes ",
                                       tf::DataTypeString(value.dtype()), value.shape().DebugString(),
                                       " to step ", step, ", but every contribution is ",
                                       tf::DataTypeString(dtype_), shape_.DebugString(),
                                       ". Every owner must run the same model.");
  }
  tf::mutex_lock lock(mu_);
  if (has_released_ && step <= released_ && step < rewound_[owner]) {
    return tf::errors::FailedPrecondition(
        "Between-graph secure sum ", channel_, ": ", me, " contributes to step ", step,
        ", but this server already released step ", released_,
        " (a stale step: a replay, or an owner restored without the owners' handshake, which rewinds it).",
        kRestart);
  }
  const Slot& mine = slots_[owner];
  if (mine.full && mine.step == step) {
    return tf::errors::AlreadyExists(
        "Between-graph secure sum ", channel_, ": ", me, " already contributed to step ", step,
        "; a second contribution is refused (two processes run as ", me,
        "? Give every owner its own TF_CONFIG task).");
  }
  if (mine.full) {
    return tf::errors::FailedPrecondition("Between-graph secure sum ", channel_, ": ", me,
                                          " contributes to step ", step, " while its contribution to step ",
                                          mine.step, " was never taken (the owners are out of step).", kRestart);
  }
  if (waiter_ != nullptr && waiter_->step != step) {
    return tf::errors::FailedPrecondition("Between-graph secure sum ", channel_, ": ", me,
                                          " contributes to step ", step, " but the chief takes step ",
                                          waiter_->step, " (the owners are out of step).", kRestart);
  }
  slots_[owner] = Slot{true, step, value};
  if (waiter_ != nullptr && Complete(step)) {
    Release(step, &waiter_->values);
    *completed = std::move(waiter_);
  }
  return OkStatus();
}

void StepAccumulator::Take(int64_t step, tf::OpKernelContext* ctx, tf::AsyncOpKernel::DoneCallback done) {
  auto waiter = std::unique_ptr<Waiter>(new Waiter{step, ctx, std::move(done), 0, false, this, {}});
  Ref();  // released by Finish
  // Finished outside the lock (done may run the next op), unless it waits.
  const tf::Status status = TakeOrWait(&waiter);
  if (waiter != nullptr) waiter->Finish(status);
}

tf::Status StepAccumulator::TakeOrWait(std::unique_ptr<Waiter>* waiter) {
  const int64_t step = (*waiter)->step;
  tf::mutex_lock lock(mu_);
  if (waiter_ != nullptr) {
    return tf::errors::FailedPrecondition("Between-graph secure sum ", channel_, ": a second take of step ", step,
                                          " while step ", waiter_->step,
                                          " is being taken; only the chief takes a step's contributions.");
  }
  if (Complete(step)) {
    Release(step, &(*waiter)->values);
    return OkStatus();
  }
  tf::CancellationManager* cm = (*waiter)->ctx->cancellation_manager();
  const tf::CancellationToken token = cm->get_cancellation_token();
  // Registered under the lock: the callback takes it too, so it runs after the waiter is in place.
  if (!cm->RegisterCallback(token, [this, cm, token]() { Cancel(cm, token); })) {
    return tf::errors::Cancelled("Between-graph secure sum ", channel_, ": the take of step ", step,
                                 " was cancelled before it began.");
  }
  (*waiter)->token = token;
  (*waiter)->registered = true;
  waiter_ = std::move(*waiter);  // finished by the put that completes the step, or by Cancel
  return OkStatus();
}

void StepAccumulator::Cancel(tf::CancellationManager* cm, tf::CancellationToken token) {
  std::unique_ptr<Waiter> cancelled;
  std::string missing;
  {
    tf::mutex_lock lock(mu_);
    // Already finished, or another step's take (tokens are per cancellation manager).
    if (waiter_ == nullptr || waiter_->token != token || waiter_->ctx->cancellation_manager() != cm) return;
    missing = Missing(waiter_->step);
    cancelled = std::move(waiter_);
  }
  cancelled->registered = false;  // this is the callback
  cancelled->Finish(tf::errors::Cancelled(
      "Between-graph secure sum ", channel_, ": the wait for step ", cancelled->step,
      " was cancelled (the session's step_timeout_secs ran out, or a task failed) while these owners had not "
      "contributed: ",
      missing, "."));
}

// --- ops -------------------------------------------------------------------

REGISTER_OP("TfeStepAccumulator")
    .Output("handle: resource")
    .Attr("owners: list(string)")
    .Attr("dtype: type")
    .Attr("shape: shape")
    .Attr("container: string = ''")
    .Attr("shared_name: string")
    .SetIsStateful()
    .SetShapeFn(tf::shape_inference::ScalarShape)
    .Doc("A step-keyed accumulator of one contribution per owner (see TfeStepPut, TfeStepTake).");

class StepAccumulatorOp : public tf::OpKernel {
 public:
  explicit StepAccumulatorOp(tf::OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("owners", &owners_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dtype", &dtype_));
    tf::PartialTensorShape shape;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shape", &shape));
    OP_REQUIRES(ctx, shape.AsTensorShape(&shape_),
                tf::errors::InvalidArgument("TfeStepAccumulator needs a fully defined shape, got ",
                                            shape.DebugString()));
    OP_REQUIRES(ctx, !owners_.empty(), tf::errors::InvalidArgument("TfeStepAccumulator needs at least one owner"));
    std::string shared_name;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("shared_name", &shared_name));
    OP_REQUIRES(ctx, !shared_name.empty(),
                tf::errors::InvalidArgument("TfeStepAccumulator needs a shared_name: the owners meet by name"));
  }

  void Compute(tf::OpKernelContext* ctx) override {
    tf::ContainerInfo cinfo;
    OP_REQUIRES_OK(ctx, cinfo.Init(ctx->resource_manager(), def()));
    StepAccumulator* accumulator = nullptr;
    OP_REQUIRES_OK(ctx, cinfo.resource_manager()->LookupOrCreate<StepAccumulator>(
                            cinfo.container(), cinfo.name(), &accumulator, [&](StepAccumulator** created) {
                              *created = new StepAccumulator(cinfo.name(), owners_, dtype_, shape_);
                              return OkStatus();
                            }));
    tf::core::ScopedUnref unref(accumulator);
    OP_REQUIRES_OK(ctx, accumulator->Verify(owners_, dtype_, shape_));
    OP_REQUIRES_OK(ctx, tf::MakeResourceHandleToOutput(ctx, 0, cinfo.container(), cinfo.name(),
                                                       tf::TypeIndex::Make<StepAccumulator>()));
  }

 private:
  std::vector<std::string> owners_;
  tf::DataType dtype_;
  tf::TensorShape shape_;
};

REGISTER_KERNEL_BUILDER(Name("TfeStepAccumulator").Device(tf::DEVICE_CPU), StepAccumulatorOp);

// The accumulator of input 0 and the scalar step of input 1 (TfeStepPut, TfeStepRewind, TfeStepTake).
tf::Status AccumulatorAndStep(tf::OpKernelContext* ctx, tf::core::RefCountPtr<StepAccumulator>* accumulator,
                              int64_t* step) {
  TF_RETURN_IF_ERROR(tf::LookupResource(ctx, tf::HandleFromInput(ctx, 0), accumulator));
  const tf::Tensor& value = ctx->input(1);
  if (!tf::TensorShapeUtils::IsScalar(value.shape())) {
    return tf::errors::InvalidArgument(ctx->op_kernel().type_string(), ": step must be a scalar, got ",
                                       value.shape().DebugString());
  }
  *step = value.scalar<int64_t>()();
  return OkStatus();
}

// An op of one owner (TfeStepPut, TfeStepRewind): its `owner` attribute.
class OwnerOp : public tf::OpKernel {
 public:
  explicit OwnerOp(tf::OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("owner", &owner_));
  }

 protected:
  int owner_;
};

REGISTER_OP("TfeStepPut")
    .Input("handle: resource")
    .Input("step: int64")
    .Input("value: dtype")
    .Attr("owner: int >= 0")
    .Attr("dtype: type")
    .SetIsStateful()
    .SetShapeFn(tf::shape_inference::NoOutputs)
    .Doc("Owner `owner`'s one contribution to `step` (refuses duplicates, stale and out-of-step steps).");

class StepPutOp : public OwnerOp {
 public:
  using OwnerOp::OwnerOp;

  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<StepAccumulator> accumulator;
    int64_t step;
    OP_REQUIRES_OK(ctx, AccumulatorAndStep(ctx, &accumulator, &step));
    std::unique_ptr<Waiter> completed;
    OP_REQUIRES_OK(ctx, accumulator->Put(owner_, step, ctx->input(2), &completed));
    if (completed != nullptr) completed->Finish(OkStatus());
  }
};

REGISTER_KERNEL_BUILDER(Name("TfeStepPut").Device(tf::DEVICE_CPU), StepPutOp);

REGISTER_OP("TfeStepRewind")
    .Input("handle: resource")
    .Input("step: int64")
    .Attr("owner: int >= 0")
    .SetIsStateful()
    .SetShapeFn(tf::shape_inference::NoOutputs)
    .Doc("Owner `owner` restored checkpoint `step` in a new session: its unreleased contribution is dropped.");

class StepRewindOp : public OwnerOp {
 public:
  using OwnerOp::OwnerOp;

  void Compute(tf::OpKernelContext* ctx) override {
    tf::core::RefCountPtr<StepAccumulator> accumulator;
    int64_t step;
    OP_REQUIRES_OK(ctx, AccumulatorAndStep(ctx, &accumulator, &step));
    OP_REQUIRES_OK(ctx, accumulator->Rewind(owner_, step));
  }
};

REGISTER_KERNEL_BUILDER(Name("TfeStepRewind").Device(tf::DEVICE_CPU), StepRewindOp);

REGISTER_OP("TfeStepTake")
    .Input("handle: resource")
    .Input("step: int64")
    .Output("values: num_owners * dtype")
    .Attr("num_owners: int >= 1")
    .Attr("dtype: type")
    .Attr("shape: shape")
    .SetIsStateful()
    .SetShapeFn([](tf::shape_inference::InferenceContext* c) {
      tf::PartialTensorShape shape;
      TF_RETURN_IF_ERROR(c->GetAttr("shape", &shape));
      tf::shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(c->MakeShapeFromPartialTensorShape(shape, &out));
      for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, out);
      return OkStatus();
    })
    .Doc("Every owner's contribution to `step`, in owner order, once all have put it (waits; cancellable).");

class StepTakeOp : public tf::AsyncOpKernel {
 public:
  explicit StepTakeOp(tf::OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_owners", &num_owners_));
  }

  void ComputeAsync(tf::OpKernelContext* ctx, DoneCallback done) override {
    tf::core::RefCountPtr<StepAccumulator> accumulator;
    int64_t step;
    OP_REQUIRES_OK_ASYNC(ctx, AccumulatorAndStep(ctx, &accumulator, &step), done);
    OP_REQUIRES_ASYNC(ctx, accumulator->num_owners() == num_owners_,
                      tf::errors::InvalidArgument("TfeStepTake of ", num_owners_, " owners from an accumulator of ",
                                                  accumulator->num_owners(), ": ", accumulator->DebugString()),
                      done);
    accumulator->Take(step, ctx, std::move(done));
  }

 private:
  int num_owners_;
};

REGISTER_KERNEL_BUILDER(Name("TfeStepTake").Device(tf::DEVICE_CPU), StepTakeOp);

}  // namespace
}  // namespace tfe_estimator
