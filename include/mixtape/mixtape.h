// The one header a mixtape user includes.
#pragma once

#include "mixtape/autograd/autocast.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/autograd/variable.h"
#include "mixtape/core/backend.h"
#include "mixtape/core/compute_mode.h"
#include "mixtape/core/device.h"
#include "mixtape/core/dispatch.h"
#include "mixtape/core/dtype.h"
#include "mixtape/core/error.h"
#include "mixtape/core/half.h"
#include "mixtape/core/shape.h"
#include "mixtape/core/storage.h"
#include "mixtape/core/tensor.h"
