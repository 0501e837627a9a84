// libsplitface_jni: ExecuTorch's C++ runtime for Java (android_demo/core). Two entry points:
// - org.splitface.core.NativeProgram: an exported program's forward method (the batch im2col programs);
// - org.splitface.core.StripLayerTrainer: the runner's strip layer (strip_layer.h: one image at a time in
//   strips that stay in cache), the release and the weight gradient of a batch from Java arrays.
// The same source is what an Android build compiles with the NDK against ExecuTorch's Android libraries; here it
// links the wheel's libraries (CMakeLists.txt), so that the demo's Java device runs them on the host JVM.
//
// Float32 tensors only, in and out: every input is checked against the program's own shapes before anything
// runs, and a mismatch or a failed call throws IllegalArgumentException or IllegalStateException with the
// reason instead of crashing the JVM.
#include <jni.h>

#include "strip_layer.h"

#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>
#include <executorch/extension/threadpool/threadpool_guard.h>

#include <atomic>
#include <cstring>

#include <memory>
#include <new>
#include <string>
#include <utility>
#include <vector>

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::extension::Module;
using executorch::extension::TensorPtr;
using executorch::extension::from_blob;
using executorch::runtime::EValue;

namespace {

constexpr const char* kMethod = "forward";
std::atomic<bool> g_single_thread{false};  // setSingleThread: XNNPACK on the calling thread, no pool

// Held during a call: with setSingleThread(true), XNNPACK runs on the calling thread (the guard is per thread).
std::unique_ptr<executorch::extension::threadpool::NoThreadPoolGuard> thread_guard() {
  if (!g_single_thread) return nullptr;
  return std::make_unique<executorch::extension::threadpool::NoThreadPoolGuard>();
}


void throw_java(JNIEnv* env, const char* cls, const std::string& why) {
  jclass c = env->FindClass(cls);
  if (c != nullptr) env->ThrowNew(c, why.c_str());
}

std::string shape_text(const std::vector<SizesType>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + ")";
}

constexpr jlong kMaxJavaArray = 0x7fffffff;  // a Java array's length is a jint

// Runs `body`; a C++ exception becomes a Java one and never crosses the JNI boundary (it would end the JVM).
template <typename T, typename F>
T guarded(JNIEnv* env, T fallback, F body) {
  try {
    return body();
  } catch (const splitface::StripError& e) {
    throw_java(env, "java/lang/IllegalStateException", e.what());
  } catch (const std::bad_alloc&) {
    throw_java(env, "java/lang/OutOfMemoryError", "no native memory for the device layer");
  } catch (const std::exception& e) {
    throw_java(env, "java/lang/IllegalStateException", e.what());
  }
  return fallback;
}

// One Java float[] per part, part(i) giving {data, length}; nullptr with a Java exception pending on failure.
template <typename Part>
jobjectArray float_arrays(JNIEnv* env, size_t count, Part part) {
  jclass cls = env->FindClass("[F");
  jobjectArray out = cls == nullptr ? nullptr : env->NewObjectArray(static_cast<jsize>(count), cls, nullptr);
  if (out == nullptr) return nullptr;  // the JVM's error is pending
  for (size_t i = 0; i < count; ++i) {
    auto [data, n] = part(i);
    if (static_cast<jlong>(n) > kMaxJavaArray) {
      throw_java(env, "java/lang/IllegalStateException", "output " + std::to_string(i) + " has " + std::to_string(n) +
                 " values, more than a Java array holds");
      return nullptr;
    }
    jfloatArray array = env->NewFloatArray(static_cast<jsize>(n));
    if (array == nullptr) return nullptr;
    env->SetFloatArrayRegion(array, 0, static_cast<jsize>(n), data);
    env->SetObjectArrayElement(out, static_cast<jsize>(i), array);
    env->DeleteLocalRef(array);
  }
  return out;
}

// A loaded program and its inputs' shapes, from its method metadata.
struct Loaded {
  std::unique_ptr<Module> module;
  std::vector<std::vector<SizesType>> shapes;
};

Loaded* handle_of(JNIEnv* env, jlong handle) {
  if (handle == 0) throw_java(env, "java/lang/IllegalStateException", "the program is closed");
  return reinterpret_cast<Loaded*>(handle);
}

}  // namespace

extern "C" JNIEXPORT jlong JNICALL Java_org_splitface_core_NativeProgram_load(JNIEnv* env, jclass, jstring path) {
  const char* chars = env->GetStringUTFChars(path, nullptr);
  if (chars == nullptr) return 0;  // OutOfMemoryError is pending
  std::string file(chars);
  env->ReleaseStringUTFChars(path, chars);
  return guarded(env, jlong{0}, [&]() -> jlong {
    auto loaded = std::make_unique<Loaded>();
    loaded->module = std::make_unique<Module>(file, Module::LoadMode::Mmap);
    if (loaded->module->load_method(kMethod) != executorch::runtime::Error::Ok) {
      throw_java(env, "java/lang/IllegalArgumentException", "cannot load the forward method of " + file);
      return 0;
    }
    auto meta = loaded->module->method_meta(kMethod);
    if (!meta.ok()) {
      throw_java(env, "java/lang/IllegalArgumentException", "no forward method metadata in " + file);
      return 0;
    }
    for (size_t i = 0; i < meta->num_inputs(); ++i) {
      auto in = meta->input_tensor_meta(i);
      if (!in.ok() || in->scalar_type() != ScalarType::Float) {
        throw_java(env, "java/lang/IllegalArgumentException", file + ": input " + std::to_string(i) +
                   " is not a float tensor");
        return 0;
      }
      loaded->shapes.emplace_back(in->sizes().begin(), in->sizes().end());
    }
    return reinterpret_cast<jlong>(loaded.release());
  });
}

extern "C" JNIEXPORT jint JNICALL Java_org_splitface_core_NativeProgram_inputCount(JNIEnv* env, jclass, jlong handle) {
  Loaded* p = handle_of(env, handle);
  return p == nullptr ? 0 : static_cast<jint>(p->shapes.size());
}

extern "C" JNIEXPORT jlongArray JNICALL Java_org_splitface_core_NativeProgram_inputShape(JNIEnv* env, jclass, jlong handle,
                                                                                       jint index) {
  Loaded* p = handle_of(env, handle);
  if (p == nullptr) return nullptr;
  if (index < 0 || static_cast<size_t>(index) >= p->shapes.size()) {
    throw_java(env, "java/lang/IndexOutOfBoundsException", "input " + std::to_string(index));
    return nullptr;
  }
  const auto& shape = p->shapes[index];
  std::vector<jlong> dims(shape.begin(), shape.end());
  jlongArray out = env->NewLongArray(static_cast<jsize>(dims.size()));
  if (out != nullptr) env->SetLongArrayRegion(out, 0, static_cast<jsize>(dims.size()), dims.data());
  return out;
}

// inputs: one float[] per program input, each holding exactly its shape's elements (C order). Returns one
// float[] per output.
extern "C" JNIEXPORT jobjectArray JNICALL Java_org_splitface_core_NativeProgram_forward(JNIEnv* env, jclass, jlong handle,
                                                                                       jobjectArray inputs) {
  Loaded* p = handle_of(env, handle);
  if (p == nullptr) return nullptr;
  jsize count = inputs == nullptr ? 0 : env->GetArrayLength(inputs);
  if (static_cast<size_t>(count) != p->shapes.size()) {
    throw_java(env, "java/lang/IllegalArgumentException", "the program takes " + std::to_string(p->shapes.size()) +
               " inputs, got " + std::to_string(count));
    return nullptr;
  }
  return guarded(env, static_cast<jobjectArray>(nullptr), [&]() -> jobjectArray {
    std::vector<std::vector<float>> buffers(count);
    std::vector<TensorPtr> tensors;  // alive until the call returns: an EValue only refers to its tensor
    std::vector<EValue> args;
    for (jsize i = 0; i < count; ++i) {
      auto array = static_cast<jfloatArray>(env->GetObjectArrayElement(inputs, i));
      size_t numel = 1;
      for (SizesType d : p->shapes[i]) numel *= static_cast<size_t>(d);
      jsize length = array == nullptr ? -1 : env->GetArrayLength(array);
      if (length < 0 || static_cast<size_t>(length) != numel) {
        throw_java(env, "java/lang/IllegalArgumentException", "input " + std::to_string(i) + " has " +
                   std::to_string(length) + " values; its shape " + shape_text(p->shapes[i]) + " takes " +
                   std::to_string(numel));
        return nullptr;
      }
      buffers[i].resize(numel);
      env->GetFloatArrayRegion(array, 0, length, buffers[i].data());
      env->DeleteLocalRef(array);
      tensors.push_back(from_blob(buffers[i].data(), p->shapes[i]));
    }
    for (auto& t : tensors) args.emplace_back(t);
    auto guard = thread_guard();
    auto result = p->module->execute(kMethod, args);
    if (!result.ok()) {
      throw_java(env, "java/lang/IllegalStateException", "executing the program failed (error " +
                 std::to_string(static_cast<int>(result.error())) + ")");
      return nullptr;
    }
    for (size_t i = 0; i < result->size(); ++i) {
      const auto& value = (*result)[i];
      if (!value.isTensor() || value.toTensor().scalar_type() != ScalarType::Float) {
        throw_java(env, "java/lang/IllegalStateException", "output " + std::to_string(i) + " is not a float tensor");
        return nullptr;
      }
    }
    return float_arrays(env, result->size(), [&](size_t i) {
      const auto& tensor = (*result)[i].toTensor();
      return std::pair<const float*, size_t>(tensor.const_data_ptr<float>(), static_cast<size_t>(tensor.numel()));
    });
  });
}

extern "C" JNIEXPORT void JNICALL Java_org_splitface_core_NativeProgram_free(JNIEnv*, jclass, jlong handle) {
  delete reinterpret_cast<Loaded*>(handle);
}

extern "C" JNIEXPORT void JNICALL Java_org_splitface_core_NativeProgram_setSingleThread(JNIEnv*, jclass, jboolean on) {
  g_single_thread = on == JNI_TRUE;
}

// ---- StripLayerTrainer: the strip layer ----

namespace {

splitface::StripLayer* strips_of(JNIEnv* env, jlong handle) {
  if (handle == 0) throw_java(env, "java/lang/IllegalStateException", "the strip layer is closed");
  return reinterpret_cast<splitface::StripLayer*>(handle);
}

// The batch's shape against the programs' and the weights set: false (with a Java exception) if they do not fit.
bool bind(JNIEnv* env, splitface::StripLayer& layer, jfloatArray images, jint n, jint h, jint w, jobjectArray weights) {
  const splitface::Geometry& g = layer.g;
  jsize length = images == nullptr ? -1 : env->GetArrayLength(images);
  if (n <= 0 || h <= 0 || w != g.W || length != static_cast<jlong>(n) * g.C * h * w) {
    throw_java(env, "java/lang/IllegalArgumentException", std::to_string(length) + " values as " + std::to_string(n) +
               " images of " + std::to_string(h) + " x " + std::to_string(w) + "; the strip programs take images of " +
               std::to_string(g.C) + " x H x " + std::to_string(g.W));
    return false;
  }
  if (static_cast<jlong>(n) * g.O * h * w > kMaxJavaArray) {
    throw_java(env, "java/lang/IllegalArgumentException", "the release of " + std::to_string(n) + " images is " +
               std::to_string(static_cast<jlong>(n) * g.O * h * w) + " values, more than a Java array holds");
    return false;
  }
  jsize count = weights == nullptr ? 0 : env->GetArrayLength(weights);
  if (static_cast<size_t>(count) != layer.shared_count()) {
    throw_java(env, "java/lang/IllegalArgumentException", "the strip programs take " +
               std::to_string(layer.shared_count()) + " weights, got " + std::to_string(count));
    return false;
  }
  try {
    layer.set_height(h);
    for (jsize i = 0; i < count; ++i) {
      auto array = static_cast<jfloatArray>(env->GetObjectArrayElement(weights, i));
      std::vector<float> values(array == nullptr ? 0 : env->GetArrayLength(array));
      if (!values.empty()) env->GetFloatArrayRegion(array, 0, static_cast<jsize>(values.size()), values.data());
      env->DeleteLocalRef(array);
      layer.set_shared(static_cast<size_t>(i), values.data(), values.size());
    }
  } catch (const splitface::StripError& e) {
    throw_java(env, "java/lang/IllegalArgumentException", e.what());
    return false;
  }
  return true;
}

}  // namespace

extern "C" JNIEXPORT jlong JNICALL Java_org_splitface_core_StripLayerTrainer_load(JNIEnv* env, jclass, jstring release,
                                                                                jstring grad) {
  auto text = [&](jstring s) {
    const char* chars = env->GetStringUTFChars(s, nullptr);
    std::string out(chars == nullptr ? "" : chars);
    if (chars != nullptr) env->ReleaseStringUTFChars(s, chars);
    return out;
  };
  std::string release_pte = text(release), grad_pte = text(grad);
  if (env->ExceptionCheck()) return 0;  // a string could not be read (OutOfMemoryError)
  return guarded(env, jlong{0}, [&]() -> jlong {
    try {
      return reinterpret_cast<jlong>(new splitface::StripLayer(release_pte, grad_pte));
    } catch (const splitface::StripError& e) {  // a bad program: the caller's argument
      throw_java(env, "java/lang/IllegalArgumentException", e.what());
      return 0;
    }
  });
}

extern "C" JNIEXPORT jintArray JNICALL Java_org_splitface_core_StripLayerTrainer_geometry(JNIEnv* env, jclass, jlong handle) {
  splitface::StripLayer* layer = strips_of(env, handle);
  if (layer == nullptr) return nullptr;
  const splitface::Geometry& g = layer->g;
  jint values[] = {g.C, g.O, g.R, g.W, g.kh, g.kw};
  jintArray out = env->NewIntArray(6);
  if (out != nullptr) env->SetIntArrayRegion(out, 0, 6, values);
  return out;
}

// The release of n images (n, C, h, w): (n, O, h, w), no noise (the caller adds it). Each image is copied in and
// its release out with Get/SetFloatArrayRegion: no Java array is pinned while the programs run.
extern "C" JNIEXPORT jfloatArray JNICALL Java_org_splitface_core_StripLayerTrainer_release(
    JNIEnv* env, jclass, jlong handle, jfloatArray images, jint n, jint h, jint w, jobjectArray weights) {
  splitface::StripLayer* layer = strips_of(env, handle);
  if (layer == nullptr || !bind(env, *layer, images, n, h, w, weights)) return nullptr;
  const splitface::Geometry& g = layer->g;
  jfloatArray out = env->NewFloatArray(static_cast<jsize>(n * g.map()));  // bounded by bind
  if (out == nullptr) return nullptr;  // OutOfMemoryError is pending
  return guarded(env, static_cast<jfloatArray>(nullptr), [&] {
    auto guard = thread_guard();
    std::vector<float> image(g.image()), map(g.map());
    size_t rows = static_cast<size_t>(g.R) * g.W;
    for (jint s = 0; s < n; ++s) {
      env->GetFloatArrayRegion(images, static_cast<jsize>(s * g.image()), static_cast<jsize>(g.image()), image.data());
      layer->release_image(image.data(), [&](int strip, const float* strip_out) {
        for (int o = 0; o < g.O; ++o)
          std::memcpy(&map[static_cast<size_t>(o) * g.H * g.W + strip * rows], strip_out + o * rows, rows * sizeof(float));
      });
      env->SetFloatArrayRegion(out, static_cast<jsize>(s * g.map()), static_cast<jsize>(g.map()), map.data());
    }
    return out;
  });
}

// The weight gradients of n images given their server gradient (n, O, h, w), summed: one float[] per weight.
extern "C" JNIEXPORT jobjectArray JNICALL Java_org_splitface_core_StripLayerTrainer_grads(
    JNIEnv* env, jclass, jlong handle, jfloatArray images, jint n, jint h, jint w, jfloatArray grad, jobjectArray weights) {
  splitface::StripLayer* layer = strips_of(env, handle);
  if (layer == nullptr || !bind(env, *layer, images, n, h, w, weights)) return nullptr;
  const splitface::Geometry& g = layer->g;
  if (!layer->has_grad()) {
    throw_java(env, "java/lang/IllegalStateException", "the strip layer was loaded without a gradient program");
    return nullptr;
  }
  jsize length = grad == nullptr ? -1 : env->GetArrayLength(grad);
  if (length != static_cast<jlong>(n) * static_cast<jlong>(g.map())) {
    throw_java(env, "java/lang/IllegalArgumentException", "a gradient of " + std::to_string(length) + " values; " +
               std::to_string(n) + " maps of " + std::to_string(g.map()) + " expected");
    return nullptr;
  }
  std::vector<std::vector<float>> sums;
  bool ok = guarded(env, false, [&] {
    auto guard = thread_guard();
    std::vector<float> image(g.image()), map(g.map());
    for (jint s = 0; s < n; ++s) {
      env->GetFloatArrayRegion(images, static_cast<jsize>(s * g.image()), static_cast<jsize>(g.image()), image.data());
      env->GetFloatArrayRegion(grad, static_cast<jsize>(s * g.map()), static_cast<jsize>(g.map()), map.data());
      layer->grad_image(image.data(), map.data(), sums);
    }
    return true;
  });
  if (!ok) return nullptr;
  return float_arrays(env, sums.size(), [&](size_t i) { return std::pair<const float*, size_t>(sums[i].data(), sums[i].size()); });
}

extern "C" JNIEXPORT void JNICALL Java_org_splitface_core_StripLayerTrainer_free(JNIEnv*, jclass, jlong handle) {
  delete reinterpret_cast<splitface::StripLayer*>(handle);
}
